"""SGLang servers as engines (`engine.backend: sglang-server`): started by Orbit, or attached to.

Started: SGLang's server through `launch.py` (which stops it when the Orbit that started it is gone)
on `engine.host` (default 127.0.0.1) and a free port, with LoRA on and the same settings the
in-process backend uses (on CPU: Orbit's shims, the torch_native backends, no CUDA
graphs; on GPU: `--base-gpu-id` from the engine's device, `--mem-fraction-static` from
engine.mem_fraction, `--tp-size` from engine.tp). Each server runs in a process group of its own,
and Orbit stops exactly that group (by its id), never anything by name. Attached servers
(`engine.servers: [http://host:port, ...]`) are left running.

Checked at start, before any training, each failure one line naming the server, the setting and
the flag that fixes it: health, the API key, the sglang version, the model (architecture; hidden
size and the final norm's weights against the recipe's checkpoint where the server's model class
answers /get_weights_by_name: Llama's does, Qwen2's does not), LoRA (on, rank, target
modules, adapters per batch for every slot plus the base model), one data-parallel rank (SGLang's
dynamic LoRA needs dp_size 1: one server per engine) and, for top-k/top-p sampling, a sampling mask
as wide as the vocabulary.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import httpx
import torch

from orbit.config import RecipeError
from orbit.engine.base import EngineStartError
from orbit.engine.devices import sglang_device
from orbit.engine.sglang.args import server_flags
from orbit.engine.sglang.engine import SGLangEngine
from orbit.engine.sglang.http import PROBE_TIMEOUT_S, HttpTransport
from orbit.engine.sglang.install import SGLANG_VERSION
from orbit.engine.sglang.local import remove, sglang_shm_files
from orbit.engine.sglang.process import CPU_MEM_FRACTION, SGLangOptions
from orbit.engine.sglang_cpu.adapter_format import sglang_target_modules
from orbit.engine.spec import ModelSpec, checkpoint_file_of, read_spec
from orbit.host.net import free_port
from orbit.host.secret import scrub

START_TIMEOUT_S = 600.0
_LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}


class ServerProcess:
    """A server Orbit started: its process (in a group of its own) and its log."""

    def __init__(self, popen: subprocess.Popen, log: Path, api_key: str | None) -> None:
        self.popen, self.log, self._key = popen, log, api_key
        self.files: list[Path] = []  # what its schedulers hold in /dev/shm, noted as it starts

    @property
    def pid(self) -> int:
        return self.popen.pid

    def exited(self) -> int | None:
        return self.popen.poll()

    def log_tail(self, lines: int = 12) -> str:
        try:
            text = "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
        text = scrub(text, self._key)
        # quoted: the log goes with the server at stop
        return f"its log ends:\n{text}" if text else ""

    def stop(self) -> None:
        """Its process group stopped (`stop_group`), its directory (log, temporary files)
        removed."""
        stop_group(self.popen)
        remove(self.files)
        shutil.rmtree(self.log.parent, ignore_errors=True)


def group_of(leader: subprocess.Popen) -> list:
    """The processes of the group `leader` leads."""
    import psutil

    group = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == leader.pid:
                group.append(proc)
        except (ProcessLookupError, psutil.Error):
            pass
    return group


def stop_group(leader: subprocess.Popen) -> None:
    """SIGKILL the process group `leader` leads (a server, its scheduler and detokenizer: nothing
    there to save; SGLang's server does not stop on SIGTERM within seconds), all but its
    multiprocessing resource tracker: that one, its clients gone, unlinks the semaphores they made
    (/dev/shm/sem.mp-*) and exits; it is waited for, then killed too if it has not. The
    load-snapshot files its schedulers held in /dev/shm go too. Only this group, by its id."""
    import psutil

    group = group_of(leader)
    trackers = [p for p in group if _is_tracker(p)]
    files = sglang_shm_files([p.pid for p in group])
    for proc in group:
        if proc not in trackers:
            _kill(proc)
    try:
        leader.wait(10)
    except subprocess.TimeoutExpired:
        pass
    psutil.wait_procs([p for p in group if p not in trackers], timeout=10)
    _, left = psutil.wait_procs(trackers, timeout=5)
    for proc in left:
        _kill(proc)
    remove(files)


def _is_tracker(proc) -> bool:
    try:
        return "resource_tracker" in " ".join(proc.cmdline())
    except Exception:  # noqa: BLE001 - already gone
        return False


def _kill(proc) -> None:
    try:
        proc.kill()
    except Exception:  # noqa: BLE001 - already gone
        pass


# How Orbit starts a server: its API key through the environment, and a watch on Orbit (launch.py).
LAUNCH = Path(__file__).with_name("launch.py")
KEY_ENV = "ORBIT_SGLANG_API_KEY"
PARENT_ENV = "ORBIT_PARENT_PID"


def launch_args(
    model: Path,
    opts: SGLangOptions,
    spec: ModelSpec,
    port: int,
    mem_fraction: float | None,
    tp: int,
    host: str = "127.0.0.1",
) -> list[str]:
    """`python -m sglang.launch_server` arguments for one engine (its API key comes through
    KEY_ENV)."""
    context = opts.context_length or min(spec.max_position_embeddings, 4096)
    args = [
        sys.executable,
        "-P",
        str(LAUNCH),
        "--model-path",
        str(model),
        "--host",
        host,
        "--port",
        str(port),
        "--skip-tokenizer-init",
        "--sleep-on-idle",  # as the in-process engine (process.py): no core held while idle
        # its warm-up waits a second at least, then runs a request that Orbit's start-up checks
        # make anyway: 18.5 s to a healthy tiny server with it, 17.4 without
        "--skip-server-warmup",
        "--dtype",
        opts.dtype,
        "--context-length",
        str(context),
        "--max-running-requests",
        str(opts.max_running),
        "--random-seed",
        str(opts.seed),
        "--sampling-mask-max-tokens",
        str(spec.vocab_size),
        "--log-level",
        "error",
    ]
    if opts.lora:
        args += [
            "--enable-lora",
            "--max-lora-rank",
            str(opts.max_lora_rank),
            "--lora-target-modules",
            *sglang_target_modules(opts.lora_target_modules),
            "--max-loras-per-batch",
            str(opts.slots + 1),
        ]
    if opts.device == "cpu":
        args += [
            "--device",
            "cpu",
            "--attention-backend",
            "torch_native",
            "--sampling-backend",
            "pytorch",
            "--disable-cuda-graph",
            "--mem-fraction-static",
            str(mem_fraction or CPU_MEM_FRACTION),
            "--max-total-tokens",
            str(opts.max_total_tokens or min(opts.max_running * context, 65536)),
        ]
        if opts.lora:
            args += ["--lora-backend", "torch_native"]  # the default (csgmv) is a Triton GPU kernel
    else:
        _, gpu = sglang_device(opts.device)
        args += ["--device", "cuda", "--base-gpu-id", str(gpu), "--tp-size", str(tp)]
        if mem_fraction is not None:
            args += ["--mem-fraction-static", str(mem_fraction)]
    return args + server_flags(dict(opts.extra))


PORT_TRIES = 3  # starts of a server whose port another process took meanwhile


class _PortTaken(Exception):
    """The free port picked for a server was taken before the server bound it."""


def launch_server(
    model: Path,
    opts: SGLangOptions,
    spec: ModelSpec,
    mem_fraction: float | None,
    tp: int,
    api_key: str | None,
    threads: int,
    host: str = "127.0.0.1",
) -> tuple[str, ServerProcess]:
    """Start one server (listening on `host`) and wait until it answers /health; its URL and
    process. A port is picked free, then the server binds it seconds later: another process may
    take it meanwhile (seen on CI with two test workers starting servers), so a start that fails on
    a taken port is tried again on a new one."""
    for attempt in range(PORT_TRIES):
        try:
            return _launch(model, opts, spec, mem_fraction, tp, api_key, threads, host)
        except _PortTaken as taken:
            if attempt == PORT_TRIES - 1:
                raise EngineStartError(
                    f"engine.backend 'sglang-server': {PORT_TRIES} free ports in a row were taken "
                    f"before the server bound them; {taken}"
                ) from None
    raise AssertionError("unreachable")


def _launch(
    model: Path,
    opts: SGLangOptions,
    spec: ModelSpec,
    mem_fraction: float | None,
    tp: int,
    api_key: str | None,
    threads: int,
    host: str,
) -> tuple[str, ServerProcess]:
    port = free_port()
    env = {**os.environ, PARENT_ENV: str(os.getpid())}
    if api_key:
        env[KEY_ENV] = api_key
    if opts.device == "cpu":
        from orbit.engine.sglang_cpu import ENV_FLAG, SHIM_DIR

        env.update({"SGLANG_USE_CPU_ENGINE": "1", ENV_FLAG: "1", "OMP_NUM_THREADS": str(threads)})
        env["PYTHONPATH"] = os.pathsep.join(
            [str(SHIM_DIR), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
        )
    # Its own directory: its log, and its temporary files (SGLang's socket files), all removed at
    # stop.
    log = Path(tempfile.mkdtemp(prefix="orbit-sglang-server-")) / f"server-{port}.log"
    env["TMPDIR"] = str(log.parent)
    with log.open("w") as out:
        popen = subprocess.Popen(
            launch_args(model, opts, spec, port, mem_fraction, tp, host),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
    server = ServerProcess(popen, log, api_key)
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        # what its schedulers hold in /dev/shm, noted as they start: a server that fails before it
        # answers (a port taken meanwhile, say) has no process left to ask at its stop
        held = sglang_shm_files([p.pid for p in group_of(popen)])
        server.files = sorted(set(server.files) | set(held))
        if server.exited() is not None:
            tail = server.log_tail()
            server.stop()
            if "address already in use" in tail:
                raise _PortTaken(tail)
            raise EngineStartError(
                f"engine.backend 'sglang-server': the server Orbit started for {url} exited (code "
                f"{server.exited()}) before answering; {tail}"
            )
        try:
            if httpx.get(f"{url}/health", timeout=PROBE_TIMEOUT_S).status_code == 200:
                held = sglang_shm_files([p.pid for p in group_of(popen)])
                server.files = sorted(set(server.files) | set(held))
                return url, server
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            tail = server.log_tail()
            server.stop()
            raise EngineStartError(
                f"engine.backend 'sglang-server': {url} did not become healthy within "
                f"{START_TIMEOUT_S:g} s; {tail}"
            )
        time.sleep(0.5)


@dataclass(frozen=True)
class ServerFacts:
    memory_saver: bool
    context_length: int


def check_server(
    url: str,
    api_key: str | None,
    api_key_env: str | None,
    model: Path,
    spec: ModelSpec,
    hf_config: dict,
    opts: SGLangOptions,
    truncated: bool,
) -> ServerFacts:
    """The start-up checks (module docstring). RecipeError: one line naming the server, the setting
    and the fix."""
    where = f"engine.servers: {url}"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=30.0) as http:

        def get(route: str) -> httpx.Response:
            try:
                res = http.get(route)
            except httpx.TransportError as e:
                raise RecipeError(
                    f"{where}: cannot be reached ({type(e).__name__}: {e}); is the server running "
                    "and is this its address?"
                ) from None
            if res.status_code == 401:
                how = (
                    f"the key in ${api_key_env}"
                    if api_key_env
                    else "no key (set engine.api_key_env)"
                )
                raise RecipeError(
                    f"{where}: the server refused {how} (HTTP 401); set engine.api_key_env to the "
                    "name of an environment variable holding its --api-key"
                )
            if res.status_code != 200:
                raise RecipeError(f"{where}: {route} answered HTTP {res.status_code}")
            return res

        # A server an earlier engine paused for a flip, and that engine then died or was killed as
        # hung, stays paused: it answers no generation, /health included (a one-token generate),
        # until told to go on. Continuing a server that is not paused does nothing.
        try:
            http.post("/continue_generation", json={})
        except httpx.TransportError:
            pass  # unreachable: /health says so, with the fix
        get("/health")
        info, server = get("/model_info").json(), get("/server_info").json()
        _check_version(where, server.get("version"))
        _check_model(where, info, hf_config, model, spec, http)
        if opts.lora:
            _check_lora(where, server, opts)
        if int(server.get("dp_size") or 1) != 1:
            raise RecipeError(
                f"{where}: dp_size is {server.get('dp_size')}; SGLang's dynamic LoRA needs one "
                "data-parallel rank: start one server per engine (--dp-size 1)"
            )
        if truncated and int(server.get("sampling_mask_max_tokens") or 0) < spec.vocab_size:
            raise RecipeError(
                f"{where}: top-k/top-p sampling needs the sampling mask as wide as the vocabulary; "
                f"start the server with --sampling-mask-max-tokens {spec.vocab_size}"
            )
    return ServerFacts(
        memory_saver=bool(server.get("enable_memory_saver")),
        context_length=int(server.get("context_length") or spec.max_position_embeddings),
    )


def _check_version(where: str, version: object) -> None:
    if version != SGLANG_VERSION:
        raise RecipeError(
            f"{where}: the server runs sglang {version}; Orbit's SGLang backends need sglang "
            f"{SGLANG_VERSION} (pip install sglang=={SGLANG_VERSION} on the server)"
        )


def _check_model(
    where: str, info: dict, local: dict, model: Path, spec: ModelSpec, http: httpx.Client
) -> None:
    fix = f"start the server with --model-path set to the recipe's model ({model}, or a copy of it)"
    if info.get("model_type") != local.get("model_type") or info.get("architectures") != local.get(
        "architectures"
    ):
        raise RecipeError(
            f"{where}: the server serves a {info.get('model_type')!r} model "
            f"{info.get('architectures')}; the recipe's is {local.get('model_type')!r} "
            f"{local.get('architectures')}: {fix}"
        )
    res = http.post(
        "/get_weights_by_name",
        json={"name": "model.norm.weight", "truncate_size": spec.hidden_size + 1},
    )
    if res.status_code != 200:
        # not every SGLang model class answers it (Qwen2's does not): the architecture check stands
        # alone
        return
    served = torch.tensor(res.json(), dtype=torch.float32).flatten()
    if served.numel() != spec.hidden_size:
        raise RecipeError(
            f"{where}: the server's model has hidden size {served.numel()}; the recipe's has "
            f"{spec.hidden_size}: {fix}"
        )
    from safetensors import safe_open

    with safe_open(str(checkpoint_file_of(model, "model.norm.weight")), framework="pt") as f:
        ours = f.get_tensor("model.norm.weight").float()
    if not torch.allclose(served, ours, rtol=1e-2, atol=1e-2):
        raise RecipeError(
            f"{where}: the server's weights differ from the recipe's model (model.norm.weight): "
            f"{fix}"
        )


def _check_lora(where: str, server: dict, opts: SGLangOptions) -> None:
    targets = sglang_target_modules(opts.lora_target_modules)
    flags = (
        f"--enable-lora --max-lora-rank {opts.max_lora_rank} --lora-target-modules "
        f"{' '.join(targets)} --max-loras-per-batch {opts.slots + 1}"
    )
    if not server.get("enable_lora"):
        raise RecipeError(f"{where}: LoRA is off on the server; start it with {flags}")
    if int(server.get("max_lora_rank") or 0) < opts.max_lora_rank:
        raise RecipeError(
            f"{where}: the server's max_lora_rank is {server.get('max_lora_rank')}, the adapter's "
            f"r is {opts.max_lora_rank}; start it with --max-lora-rank {opts.max_lora_rank}"
        )
    served = set(server.get("lora_target_modules") or [])
    if "all" not in served and not set(targets) <= served:
        raise RecipeError(
            f"{where}: the server's lora_target_modules {sorted(served)} lack "
            f"{sorted(set(targets) - served)}; start it with --lora-target-modules "
            f"{' '.join(targets)}"
        )
    if int(server.get("max_loras_per_batch") or 0) < opts.slots + 1:
        raise RecipeError(
            f"{where}: the server's max_loras_per_batch is {server.get('max_loras_per_batch')}; "
            f"{opts.slots} slots and the base model need {opts.slots + 1}: start it with "
            f"--max-loras-per-batch {opts.slots + 1}"
        )
    loaded = server.get("max_loaded_loras")
    # SGLang would evict a slot's adapter mid-run
    if loaded is not None and int(loaded) < opts.slots:
        raise RecipeError(
            f"{where}: the server keeps at most {loaded} LoRA adapters loaded (max_loaded_loras), "
            f"fewer than the {opts.slots} slots it must hold; start it without --max-loaded-loras "
            f"or with --max-loaded-loras {opts.slots}"
        )


def is_local(url: str) -> bool:
    """Whether a server runs on this host (it reads Orbit's own adapter files and shared memory)."""
    host = urlparse(url).hostname or ""
    if host in _LOCAL_HOSTS:
        return True
    try:
        return socket.gethostbyname(host) in {
            socket.gethostbyname(socket.gethostname()),
            "127.0.0.1",
        }
    except OSError:
        return False


def start_server_engine(
    model: str | Path,
    opts: SGLangOptions,
    url: str | None = None,
    api_key: str | None = None,
    api_key_env: str | None = None,
    adapter_dir: Path | None = None,
    adapter_transport: str = "auto",
    mem_fraction: float | None = None,
    tp: int = 1,
    timeout_s: float = 600.0,
    truncated: bool = False,
    threads: int = 1,
    host: str = "127.0.0.1",
) -> SGLangEngine:
    """One engine on an SGLang server: the one at `url` (attached), or one Orbit starts (on
    `host`)."""
    model = Path(model)
    spec, hf_config = read_spec(model)
    server = None
    if url is None:
        url, server = launch_server(model, opts, spec, mem_fraction, tp, api_key, threads, host)
    try:
        facts = check_server(url, api_key, api_key_env, model, spec, hf_config, opts, truncated)
        use_dir = adapter_transport == "dir" or (adapter_transport == "auto" and not is_local(url))
        if use_dir and adapter_dir is None:
            raise RecipeError(
                f"engine.adapter_dir: required for {url}, which is not on this host: a directory "
                "both Orbit and the server can read (local disk or a shared filesystem)"
            )
        transport = HttpTransport(
            url,
            api_key,
            Path(adapter_dir) / f"server-{urlparse(url).port}" if use_dir and adapter_dir else None,
            timeout_s,
            facts.memory_saver,
            server=server,
            max_connections=max(64, 4 * opts.max_running),
        )
        engine = SGLangEngine(
            transport,
            asyncio.new_event_loop(),
            model,
            spec,
            hf_config,
            opts,
            facts.context_length,
            pid=server.pid if server is not None else 0,
            label=f"SGLang server {url}",
            liveness_s=1.0,
        )
        if server is None and opts.lora:
            engine.clear_slots()
        return engine
    except BaseException:
        if server is not None:
            server.stop()
        raise
