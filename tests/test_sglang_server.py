"""`engine.backend: sglang-server` on real SGLang servers (CPU, tiny models, 127.0.0.1 only):
servers Orbit starts, a server the test starts and Orbit attaches to, the directory transport, the
start-up checks, a server killed mid-run. Every test stops exactly the processes it started."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from run_helpers import (
    check_no_request_ran_on_a_slot_being_written,
    checked,
    recipe_dict,
    run_metrics,
    run_timeline,
)

from orbit.config import AdapterConfig, RecipeError, TrainerConfig
from orbit.engine.base import EngineError, SamplingParams
from orbit.engine.sglang.server import stop_group
from orbit.engine.sglang_cpu import ENV_FLAG, SHIM_DIR
from orbit.host.net import free_port
from orbit.run.lifecycle import train

# skips without sglang, fails in CI (tests/sglang_gate.py)
# alone: its tests compare /dev/shm before and after, and bound how soon a loss is noticed
pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.alone]

KEY = "orbit-test-key-3f9c"
KEY_ENV = "ORBIT_TEST_SGLANG_KEY"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _start_server(
    model: Path, lora: bool, api_key: str | None = None
) -> tuple[str, subprocess.Popen]:
    """What a user runs by hand (README, "SGLang servers"): python -m sglang.launch_server ..."""
    port = free_port()
    args = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
        "--sampling-backend",
        "pytorch",
        "--disable-cuda-graph",
        "--mem-fraction-static",
        "0.05",
        "--max-total-tokens",
        "8192",
        "--context-length",
        "512",
        "--skip-tokenizer-init",
        "--sleep-on-idle",
        "--dtype",
        "float32",
        "--max-running-requests",
        "16",
        "--sampling-mask-max-tokens",
        "512",
        "--log-level",
        "error",
    ]
    if lora:
        args += [
            "--enable-lora",
            "--max-lora-rank",
            "8",
            "--lora-target-modules",
            *TARGETS,
            "--max-loras-per-batch",
            "4",
            "--lora-backend",
            "torch_native",
        ]
    if api_key:
        args += ["--api-key", api_key]
    # its socket files: removed with it (_stop)
    scratch = tempfile.mkdtemp(prefix="orbit-test-server-")
    env = {
        **os.environ,
        "SGLANG_USE_CPU_ENGINE": "1",
        ENV_FLAG: "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(SHIM_DIR),
        "TMPDIR": scratch,
    }
    proc = subprocess.Popen(
        args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    proc.scratch = scratch
    url = f"http://127.0.0.1:{port}"
    try:
        _await_health(url, proc)
    except BaseException:
        _stop(proc)  # a server that failed to start is still the test's to stop
        raise
    return url, proc


def _await_health(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 240
    seen = "no answer"
    while True:
        assert proc.poll() is None, "the test's server exited while starting"
        try:
            answer = httpx.get(f"{url}/health", timeout=2)
            if answer.status_code == 200:
                return
            seen = f"/health answered {answer.status_code}"
        except httpx.TransportError as err:
            seen = f"/health: {type(err).__name__}"
        assert time.monotonic() < deadline, f"the test's server did not start (last: {seen})"
        time.sleep(0.5)


def _stop(proc: subprocess.Popen) -> None:
    """Its own process group, by its id: the server and its children, nothing else (the way Orbit
    stops its own servers, so that no semaphore or shared-memory file is left)."""
    stop_group(proc)
    shutil.rmtree(proc.scratch, ignore_errors=True)


@pytest.fixture(scope="module")
def served(tiny_llama):
    """A LoRA server with an API key, started by the test (the user's own, for attach mode)."""
    url, proc = _start_server(tiny_llama, lora=True, api_key=KEY)
    yield url, proc
    _stop(proc)


@pytest.fixture
def plain_qwen2(tiny_qwen2):
    """A server of another model, without LoRA (one test's: stopped after it, so that its idle
    scheduler does not hold a core through the rest of the module)."""
    url, proc = _start_server(tiny_qwen2, lora=False)
    yield url
    _stop(proc)


def _recipe(model: Path, out: Path, **patch) -> dict:
    return recipe_dict(
        model,
        out,
        {
            "adapter": {"type": "lora", "r": 8, "alpha": 16, "target_modules": TARGETS},
            "engine": {"backend": "sglang-server", "max_inflight": 8, "max_running": 8, "slots": 3},
            "mode": "double-buffer",
            "max_staleness": 1,
        },
        **patch,
    )


def _check(run_dir: Path, steps: int | None) -> list[dict]:
    """Every step's line (`steps` of them; None: any number), logprobs agreeing, no slot written
    under a request."""
    rows = run_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(len(rows) if steps is None else steps))
    # the in-process bound
    assert all(r["logprob_diff"] is None or r["logprob_diff"] < 1e-3 for r in rows)
    assert any(r["logprob_diff"] is not None for r in rows)
    check_no_request_ran_on_a_slot_being_written(run_timeline(run_dir))
    return rows


# ---- servers Orbit starts ------------------------------------------------------------------------
# First in this module: the attach tests' servers (module fixtures) are not started yet. An idle
# SGLang scheduler on CPU keeps a core busy, and two of them made this test 3 times slower (237 s
# against 81 s).
@pytest.mark.timeout(420)
def test_two_started_servers_one_killed_mid_run_through_a_pipe(tmp_path, tiny_llama):
    """Two servers Orbit starts, with an API key, read through a pipe: they listen on 127.0.0.1 only
    and the key is on no command line. One is SIGKILLed mid-run: noticed within seconds, the other
    serves meanwhile, a new server starts, takes the newest adapter and rejoins; two steps later
    Ctrl-C. Every step is trained and saved, and nothing Orbit started is left (end-of-file within
    seconds, no process, no /dev/shm entry: not the killed server's semaphores and load file
    either)."""
    key = "orbit-started-key-81d2"
    run_dir = tmp_path / "run"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        json.dumps(
            _recipe(
                tiny_llama,
                run_dir,
                trainer={"steps": 2000},
                engine={"api_key_env": KEY_ENV, "replicas": 2},
            )
        )
    )
    killed: dict = {}

    def kill_one_then_ctrl_c(proc) -> None:  # whatever happens here, Ctrl-C ends the run
        try:
            kill_one(proc)
        finally:
            proc.send_signal(signal.SIGINT)

    def kill_one(proc) -> None:
        if _when(lambda: (run_dir / "metrics.jsonl").exists() and len(run_metrics(run_dir)) >= 2):
            servers = [
                p
                for p in psutil.Process(proc.pid).children()
                if p.status() != psutil.STATUS_ZOMBIE
                and "sglang/launch.py" in " ".join(p.cmdline())
            ]
            killed["at"] = time.time()
            os.killpg(servers[0].pid, signal.SIGKILL)  # its whole group, as bench/soak.py does
            log = run_dir / "run.log"
            _when(lambda: log.exists() and "rejoined the pool" in log.read_text(), timeout=180)
            steps = len(run_metrics(run_dir))
            _when(lambda: len(run_metrics(run_dir)) >= steps + 2, timeout=60)

    run = _piped_train(recipe, key, during=kill_one_then_ctrl_c)
    _check_piped(run, run_dir, key, code=130)
    assert run.listening == {"127.0.0.1"}, run.listening
    rows = _check(run_dir, None)
    assert rows[-1]["rejoined"] == 1 and rows[-1]["engines_alive"] == 2, rows[-1]
    events = run_timeline(run_dir)
    lost = next(e for e in events if e["kind"] == "lost")
    assert lost["t0"] - killed["at"] < 5.0, "a killed server must be noticed within seconds"
    back = next(e for e in events if e["kind"] == "rejoined")
    assert {e["engine"] for e in events if e["kind"] == "request"} == {0, 1}
    print(
        f"\nstarted server killed: noticed in {lost['t0'] - killed['at']:.1f} s, serving again "
        f"after {back['t0'] - killed['at']:.1f} s; end-of-file {run.eof_after_exit_s:.2f} s after "
        f"exit, listening on {run.listening}"
    )


# ---- attach mode ---------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_attach_trains_and_leaves_the_server_running(tmp_path, tiny_llama, served, monkeypatch):
    url, proc = served
    monkeypatch.setenv(KEY_ENV, KEY)
    run_dir = tmp_path / "run"
    recipe = checked(
        _recipe(
            tiny_llama,
            run_dir,
            engine={"servers": [url], "api_key_env": KEY_ENV},
            rollout={"top_p": 0.9},
        )
    )
    train(recipe, live=False)
    rows = _check(run_dir, 3)
    # same host: Orbit's own adapter files in /dev/shm
    assert rows[0]["adapter_transport"] == ["local"]
    # left running
    assert proc.poll() is None and httpx.get(f"{url}/health", timeout=5).status_code == 200
    for f in run_dir.rglob("*"):  # the key is never written down
        assert not f.is_file() or KEY.encode() not in f.read_bytes(), f


@pytest.mark.timeout(300)
def test_start_up_checks_fail_before_training_with_the_fix(
    tmp_path, tiny_llama, tiny_qwen2, served, plain_qwen2, monkeypatch
):
    url, _ = served
    monkeypatch.setenv(KEY_ENV, "not-the-key")
    cases = [
        (
            _recipe(tiny_llama, tmp_path / "a", engine={"servers": [url], "api_key_env": KEY_ENV}),
            f"engine.servers: {url}: the server refused the key in ${KEY_ENV} (HTTP 401)",
        ),
        (
            _recipe(tiny_qwen2, tmp_path / "b", engine={"servers": [plain_qwen2]}),
            f"engine.servers: {plain_qwen2}: LoRA is off on the server; start it with "
            "--enable-lora",
        ),
        (
            _recipe(tiny_llama, tmp_path / "c", engine={"servers": [plain_qwen2]}),
            f"engine.servers: {plain_qwen2}: the server serves a 'qwen2' model "
            "['Qwen2ForCausalLM']; the recipe's is 'llama'",
        ),
    ]
    for data, message in cases:
        with pytest.raises(RecipeError) as err:
            train(checked(data), live=False)
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
        assert not Path(data["out"]).exists()  # nothing trained, nothing left
    # the same on the command line: one line, exit 2
    recipe = tmp_path / "r.yaml"
    recipe.write_text(json.dumps(cases[2][0]))
    res = subprocess.run(
        [sys.executable, "-m", "orbit.cli", "train", str(recipe), "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        res.returncode == 2
        and "--model-path" in " ".join(res.stderr.split())
        and "Traceback" not in res.stderr
    )


@pytest.mark.timeout(120)
def test_a_server_left_paused_by_an_engine_that_died_is_taken_back(tiny_llama, served):
    """An engine killed while its server was paused for a flip leaves the server paused, answering
    no generation and no /health; attaching again continues it first, so it serves."""
    from orbit.engine.sglang.process import SGLangOptions
    from orbit.engine.sglang.server import start_server_engine

    url, _ = served
    headers = {"Authorization": f"Bearer {KEY}"}
    httpx.post(
        f"{url}/pause_generation", json={"mode": "in_place"}, headers=headers, timeout=30
    ).raise_for_status()
    opts = SGLangOptions(
        max_running=8, slots=2, max_lora_rank=8, lora_target_modules=tuple(TARGETS)
    )
    t0 = time.monotonic()
    with start_server_engine(tiny_llama, opts, url=url, api_key=KEY, timeout_s=60) as engine:
        done = engine.generate([5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True)).result(
            60
        )
    # a paused server's /health takes 20 s
    assert len(done.output_ids) == 4 and time.monotonic() - t0 < 15


@pytest.mark.timeout(300)
def test_the_directory_transport_writes_peft_that_peft_loads(tmp_path, tiny_llama, served):
    """Adapters for other hosts go through engine.adapter_dir in peft's format; what the server
    loaded is what peft computes; versions no slot uses any more are deleted."""
    from peft import PeftModel

    from orbit.engine.sglang.process import SGLangOptions
    from orbit.engine.sglang.server import start_server_engine
    from orbit.train.trainer import Trainer

    url, _ = served
    opts = SGLangOptions(
        max_running=8, slots=2, max_lora_rank=8, lora_target_modules=tuple(TARGETS)
    )
    engine = start_server_engine(
        tiny_llama,
        opts,
        url=url,
        api_key=KEY,
        adapter_dir=tmp_path / "adapters",
        adapter_transport="dir",
        timeout_s=60,
    )
    try:
        trainer = Trainer(
            tiny_llama,
            AdapterConfig(r=8, alpha=16, target_modules=TARGETS),
            TrainerConfig(),
            1.0,
            0,
        )
        with torch.no_grad():
            for name, p in trainer.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.2)
        for slot, version in ((0, 1), (1, 2), (0, 3)):
            engine.load_adapter(slot, trainer.adapter_tensors(), trainer.adapter_config(), version)
        written = sorted(p.name for p in (tmp_path / "adapters").rglob("orbit-slot-*"))
        assert written == ["orbit-slot-0-v3", "orbit-slot-1-v2"]  # v1: no slot uses it any more
        path = next((tmp_path / "adapters").rglob("orbit-slot-0-v3"))
        assert {p.name for p in path.iterdir()} == {
            "adapter_model.safetensors",
            "adapter_config.json",
        }
        from transformers import AutoModelForCausalLM

        peft_model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tiny_llama), path
        ).eval()
        prompt = [5, 6, 7, 8]
        greedy = engine.generate(
            prompt,
            SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True),
            # what the server serves from the directory it read
            slot=0,
        ).result(60)
        cont = greedy.output_ids
        with torch.no_grad():
            logp = torch.log_softmax(
                peft_model(torch.tensor([prompt + cont])).logits[0].float(), -1
            )
        want = logp[torch.arange(3, 3 + len(cont)), torch.tensor(cont)].tolist()
        assert max(abs(a - b) for a, b in zip(greedy.logprobs, want, strict=True)) < 1e-4
        # a bad push is refused and the slot keeps serving what it had
        bad = {k: v * float("nan") for k, v in trainer.adapter_tensors().items()}
        with pytest.raises(EngineError, match="NaN"):
            engine.load_adapter(0, bad, trainer.adapter_config(), 4)
        engine.activate(0)
        assert (
            engine.generate(prompt, SamplingParams(max_new_tokens=4)).result(60).version_start == 3
        )
    finally:
        engine.shutdown()
    assert not list((tmp_path / "adapters").rglob("orbit-slot-*"))


# ---- nothing outlives Orbit, and the key stays secret --------------------------------------------


@dataclass
class Piped:
    code: int
    output: str
    eof_after_exit_s: float
    # processes it started (seen as its descendants while it ran) that are still there
    left: list[str]
    new_shm: set[str]  # /dev/shm entries it left
    cmdlines_with_key: list[str]
    listening: set[str]  # addresses its servers listened on


def _piped_train(recipe: Path, key: str, during=None) -> Piped:
    """`orbit train RECIPE | tee`: stdout and stderr into a pipe, read to end-of-file, while the
    command line of every process Orbit starts is watched for the key and its servers' listening
    addresses noted. `during(proc)` runs in a thread meanwhile (a fault to inject)."""
    shm_before, t0 = set(os.listdir("/dev/shm")), time.time()
    proc = subprocess.Popen(
        [sys.executable, "-m", "orbit.cli", "train", str(recipe), "--quiet"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, KEY_ENV: key},
    )
    chunks, eof, seen, listening, descendants = [], {}, [], set(), {}

    def read() -> None:
        for chunk in iter(lambda: proc.stdout.read1(65536), b""):
            chunks.append(chunk)
        eof["at"] = time.monotonic()

    def watch() -> None:
        while proc.poll() is None:
            try:
                descendants.update(
                    {c.pid: c for c in psutil.Process(proc.pid).children(recursive=True)}
                )
            except psutil.Error:
                pass
            for p in psutil.process_iter(["cmdline", "create_time"]):
                if p.info["create_time"] < t0 - 1:
                    continue  # not Orbit's (the user's own server has its key on its command line)
                line = " ".join(p.info["cmdline"] or [])
                if key in line:
                    seen.append(line)
                if "sglang/launch.py" in line:
                    try:
                        listening.update(
                            c.laddr.ip for c in p.net_connections("tcp") if c.status == "LISTEN"
                        )
                    except psutil.Error:
                        pass
            time.sleep(0.5)

    threads = [
        threading.Thread(target=read, daemon=True),
        threading.Thread(target=watch, daemon=True),
    ]
    if during is not None:
        threads.append(threading.Thread(target=during, args=(proc,), daemon=True))
    for t in threads:
        t.start()
    try:
        proc.wait(timeout=400)
    finally:
        proc.kill()
    exited = time.monotonic()
    threads[0].join(30)
    time.sleep(1.0)  # anything it left has had time to show
    left = [
        f"{p.pid} {p.name()}: {' '.join(p.cmdline())}"
        for p in descendants.values()
        if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    ]
    return Piped(
        proc.returncode,
        b"".join(chunks).decode(errors="replace"),
        eof.get("at", float("inf")) - exited,
        left,
        set(os.listdir("/dev/shm")) - shm_before,
        seen,
        listening,
    )


def _check_piped(run: Piped, run_dir: Path, key: str, code: int = 0) -> None:
    assert run.code == code, run.output
    assert run.eof_after_exit_s < 5.0, (
        f"the pipe stayed open {run.eof_after_exit_s:.1f} s after Orbit exited"
    )
    assert not run.left, f"left behind: {run.left}"
    assert not run.new_shm, f"left in /dev/shm: {run.new_shm}"
    assert not run.cmdlines_with_key, run.cmdlines_with_key
    assert key not in run.output
    for f in run_dir.rglob("*"):  # recipe copy, run.log, metrics, samples, checkpoints
        assert not f.is_file() or key.encode() not in f.read_bytes(), f


@pytest.mark.timeout(420)
def test_attached_full_weight_pushes_through_a_pipe_leave_nothing(tmp_path, tiny_llama, served):
    """Attached, sync mode: full weights reach the server as safetensors files in Orbit's directory
    in /dev/shm (`/update_weights_from_disk`), and at the end the server gets the checkpoint's
    weights back (the next test trains against it and checks logprob agreement). Read through a
    pipe: end-of-file within seconds of Orbit's exit, no process and no /dev/shm entry left, the key
    nowhere."""
    url, _ = served
    run_dir = tmp_path / "run"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        json.dumps(
            _recipe(
                tiny_llama,
                run_dir,
                mode="sync",
                trainer={"steps": 3},
                engine={"servers": [url], "api_key_env": KEY_ENV},
            )
        )
    )
    run = _piped_train(recipe, KEY)
    _check_piped(run, run_dir, KEY)
    assert all(r["full_push"] for r in run_metrics(run_dir))
    print(f"\nattached, full weights: end-of-file {run.eof_after_exit_s:.2f} s after exit")


def _when(predicate, timeout: float = 300.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@pytest.mark.timeout(420)
def test_an_attached_server_that_hangs_and_answers_again_is_taken_back(
    tmp_path, tiny_llama, served, monkeypatch
):
    """The user's server stops answering (SIGSTOP) past the ping bound, then answers again
    (SIGCONT): it leaves the pool, is checked again once /health answers, brought to the newest
    adapter, and rejoins; the run trains every step."""
    url, proc = served
    monkeypatch.setenv(KEY_ENV, KEY)
    run_dir = tmp_path / "run"
    # A server that never rejoins stops the run within the stall bound, saying why, well inside the
    # test's timeout
    recipe = checked(
        _recipe(
            tiny_llama,
            run_dir,
            engine={"servers": [url], "api_key_env": KEY_ENV},
            trainer={"steps": 10},
            rollout={"stall_timeout_s": 150},
        )
    )
    seen: dict = {}

    def hang_then_answer():
        # Stopped after the first of 10 steps, most of the run's rollouts are still to be generated,
        # so it waits for the server to rejoin. Stopped after the second of 6, a loaded CI machine
        # once finished the run from what was generated before the stop, and the server never
        # rejoined (rejoined 0).
        if _when(lambda: (run_dir / "metrics.jsonl").exists() and len(run_metrics(run_dir)) >= 1):
            os.killpg(proc.pid, signal.SIGSTOP)  # the server and its scheduler: nothing answers
            seen["stopped"] = time.time()
            _when(
                lambda: (
                    (run_dir / "run.log").exists()
                    and "left the pool" in (run_dir / "run.log").read_text()
                ),
                timeout=60,
            )
            os.killpg(proc.pid, signal.SIGCONT)
            seen["continued"] = time.time()

    thread = threading.Thread(target=hang_then_answer, daemon=True)
    thread.start()
    try:
        train(recipe, live=False)
    finally:
        thread.join(90)
        os.killpg(proc.pid, signal.SIGCONT)  # whatever happened, the module's server answers again
    rows = _check(run_dir, 10)
    assert rows[-1]["rejoined"] == 1
    events = run_timeline(run_dir)
    lost = next(e for e in events if e["kind"] == "lost")
    back = next(e for e in events if e["kind"] == "rejoined")
    assert "hung" in lost["reason"] and back["t0"] > seen["continued"]
    print(
        f"\nattached server hung: noticed in {lost['t0'] - seen['stopped']:.1f} s, serving again "
        f"{back['t0'] - seen['continued']:.1f} s after it answered"
    )
    assert proc.poll() is None and httpx.get(f"{url}/health", timeout=5).status_code == 200


def test_a_server_whose_port_was_taken_meanwhile_starts_on_another(
    tmp_path, tiny_llama, monkeypatch
):
    """Orbit picks a free port, the server binds it seconds later: another process may take it in
    between (two test workers starting servers did, on CI). The start is tried on a new port."""
    import socket

    from tinker_helpers import serving

    import orbit.engine.sglang.server as server_module

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    picked = []

    def pick() -> int:
        picked.append(taken if not picked else free_port())
        return picked[-1]

    monkeypatch.setattr(server_module, "free_port", pick)
    before = {f.name for f in Path("/dev/shm").glob("sglang_*")}
    try:
        engine = {"backend": "sglang-server", "slots": 2}
        with serving(tiny_llama, tmp_path / "serve", engine=engine) as (_, service):
            done = service.bases[0].sampler.caches[0].engine.generate([1, 2, 3], SamplingParams(4))
            assert len(done.result(120).output_ids) >= 1
    finally:
        held.close()
    assert len(picked) == 2 and picked[0] == taken != picked[1]
    # the failed start's load-snapshot file went with it (and the served one at the stop)
    assert {f.name for f in Path("/dev/shm").glob("sglang_*")} <= before
