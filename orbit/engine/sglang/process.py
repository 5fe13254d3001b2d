"""Start and stop SGLang's in-process engine for Orbit's SGLang backend (engine.py, transport.py).

Process-level concerns of `sglang.Engine` 0.5.23 that the backend must handle:
- CPU: Orbit's compatibility shims are turned on before sglang is imported
  (orbit.engine.sglang_cpu);
- the engine gets its own asyncio loop (run later in a thread of its own by the backend), and its
  scheduler process is sized by OMP_NUM_THREADS (= engine.threads);
- SGLang's children SIGQUIT their parent when they fail and SGLang's own handler then kills the
  whole process tree: Orbit installs `on_sigquit` instead (liveness is decided by the processes);
- `Engine.shutdown()` kills every child of the calling process and is registered with atexit:
  Orbit unregisters it and kills only SGLang's own process tree (`kill_sglang`), then closes
  SGLang's ZeroMQ contexts with linger 0 (`close_zmq`; a queued message for a dead peer would
  otherwise block the garbage collection of the context forever).
"""

from __future__ import annotations

import asyncio
import atexit
import importlib.util
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from orbit.engine.base import EngineError, EngineStartError
from orbit.engine.devices import sglang_device
from orbit.engine.sglang.forked import engine_class, forking
from orbit.engine.sglang.install import INSTALL_HINT
from orbit.engine.sglang.local import remove, start_files
from orbit.engine.sglang_cpu.adapter_format import sglang_target_modules
from orbit.engine.spec import read_spec

# On a CPU, SGLang sizes its KV pool from the machine's free memory: what is free after loading the
# weights, less (1 - this) of what was free before. Other processes (a trainer, a second test
# worker) allocate meanwhile, so a small fraction fails start-up at random ("Loaded weights leave no
# GPU memory for the KV cache"); the pool itself is capped by --max-total-tokens anyway.
CPU_MEM_FRACTION = 0.5
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

sigquits: list[float] = []


def on_sigquit(signum, frame) -> None:  # noqa: ARG001 - signal handler signature
    """SIGQUIT handler while SGLang runs in this process (`custom_sigquit_handler`).

    SGLang's children send SIGQUIT to their parent when they fail; SGLang's own handler then kills
    the whole process tree, Orbit's trainer included. This one only records the time. The
    watchdog decides by the processes themselves (a failing SGLang process exits after
    signalling), so another engine's SIGQUIT in the same process cannot kill this one.
    Module-level because SGLang pickles it into its children with the server arguments."""
    sigquits.append(time.time())


def _quiet_sigquit_notice(record: logging.LogRecord) -> bool:
    """SGLang logs passing `custom_sigquit_handler` at error level; it is Orbit's normal set-up."""
    return "custom SIGQUIT handler" not in record.getMessage()


@dataclass(frozen=True)
class SGLangOptions:
    max_running: int = 32  # SGLang's max_running_requests
    dtype: str = "float32"
    device: str = "cpu"
    # CPU: torch threads of SGLang's scheduler process (OMP_NUM_THREADS at its start)
    threads: int = 1
    seed: int = 0  # SGLang's random_seed
    # False: no LoRA at all (OFT recipes push merged weights; slots stay unusable)
    lora: bool = True
    slots: int = 2  # adapter slots: SGLang adapter names orbit-slot-0 .. orbit-slot-(slots-1)
    max_lora_rank: int = 8
    lora_target_modules: tuple[str, ...] = ALL_TARGETS  # completed to whole q/k/v, gate/up groups
    context_length: int | None = None  # None: min(max_position_embeddings, 4096)
    # KV pool; None: max_running * context (<= 65536) on CPU, SGLang's on GPU
    max_total_tokens: int | None = None
    memory_saver: bool | None = None  # None: on with CUDA when torch_memory_saver is installed
    # --mem-fraction-static; None: SGLang's own on a GPU, CPU_MEM_FRACTION on a CPU
    mem_fraction: float | None = None
    tp: int = 1  # GPU: --tp-size, GPUs base_gpu_id .. base_gpu_id + tp - 1
    # engine.sglang_args: further ServerArgs, checked at load (args.py)
    extra: tuple[tuple[str, object], ...] = ()


def launch(model_path: str | Path, opts: SGLangOptions):
    """Start `sglang.Engine` (LoRA on, room for two slots and the base model in a batch).

    Returns (engine, its event loop, spec, HF config, memory saver on?, the SIGQUIT handler it
    replaced). CPU: turns on Orbit's compatibility shims first. Raises EngineError when sglang is
    missing and EngineDeadError when its processes fail to start.
    """
    path = Path(model_path)
    spec, hf_config = read_spec(path)
    on_cpu = opts.device == "cpu"
    if on_cpu:
        from orbit.engine.sglang_cpu import prepare_cpu_environment

        prepare_cpu_environment()  # before anything imports sglang
    try:
        from sglang.srt.entrypoints.engine import Engine as SGLEngine
    except ImportError as e:
        raise EngineError(
            f"engine.backend 'sglang': cannot import sglang ({e}); install it with: {INSTALL_HINT}"
        ) from e
    import psutil

    context = opts.context_length or min(spec.max_position_embeddings, 4096)
    device, gpu = sglang_device(opts.device)  # SGLang takes 'cuda' and a GPU id, not 'cuda:1'
    kwargs: dict = dict(
        model_path=str(path),
        device=device,
        dtype=opts.dtype,
        random_seed=opts.seed,
        max_running_requests=opts.max_running,
        context_length=context,
        skip_tokenizer_init=True,
        log_level="error",
        # an idle scheduler waits on its sockets instead of polling: otherwise it holds a core (a
        # CPU's, or a GPU host's) whenever it has nothing to run, slowing the trainer beside it
        sleep_on_idle=True,
        # a top-k/top-p request returns its sampling support (truncated logprobs); SGLang aborts a
        # request whose support is larger than this, and no support is larger than the vocabulary
        sampling_mask_max_tokens=spec.vocab_size,
    )
    if opts.lora:
        kwargs.update(
            enable_lora=True,
            max_lora_rank=opts.max_lora_rank,
            lora_target_modules=sglang_target_modules(opts.lora_target_modules),
            # every slot and the base model in one batch (None counts)
            max_loras_per_batch=opts.slots + 1,
        )
    if on_cpu:
        kwargs.update(
            attention_backend="torch_native",
            sampling_backend="pytorch",
            disable_cuda_graph=True,
            mem_fraction_static=opts.mem_fraction or CPU_MEM_FRACTION,
            max_total_tokens=opts.max_total_tokens or min(opts.max_running * context, 65536),
        )
        if opts.lora:
            kwargs["lora_backend"] = "torch_native"  # the default (csgmv) is a Triton GPU kernel
    else:
        kwargs.update(base_gpu_id=gpu, tp_size=opts.tp)
        if opts.mem_fraction is not None:
            kwargs["mem_fraction_static"] = opts.mem_fraction
        if opts.max_total_tokens:
            kwargs["max_total_tokens"] = opts.max_total_tokens
    memory_saver = opts.memory_saver
    if memory_saver is None:
        memory_saver = not on_cpu and importlib.util.find_spec("torch_memory_saver") is not None
    kwargs["enable_memory_saver"] = bool(memory_saver)
    kwargs.update(dict(opts.extra))
    previous_sigquit = None
    logging.getLogger("sglang.srt.entrypoints.engine").addFilter(_quiet_sigquit_notice)
    if threading.current_thread() is threading.main_thread():
        previous_sigquit = signal.getsignal(signal.SIGQUIT)
        kwargs["custom_sigquit_handler"] = on_sigquit

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    # the engine's own loop (Engine() picks up the thread's current loop)
    loop = asyncio.new_event_loop()
    saved_env = os.environ.get("OMP_NUM_THREADS")
    if on_cpu:
        # SGLang's scheduler sizes torch's pool by it
        os.environ["OMP_NUM_THREADS"] = str(opts.threads)
    asyncio.set_event_loop(loop)
    try:
        if on_cpu:  # its two processes fork from the fork server, SGLang imported (forked.py)
            with forking():
                engine = engine_class(SGLEngine)(**kwargs)
        else:
            engine = SGLEngine(**kwargs)
    except BaseException as e:
        started = [
            p
            for p in psutil.Process().children(recursive=True)
            if p.pid not in before and is_sglang(p)
        ]
        kill_sglang([p.pid for p in started], [])
        # the half-built tokenizer manager's sockets: left open, the context's finalizer waits for
        # them whenever the garbage collector gets to it, and hangs whatever runs then; and the
        # files the start made, which no process of it is left to remove
        half_built = _frame_locals(e.__traceback__)
        close_zmq(*half_built)
        for ports in {id(o): o for o in half_built if type(o).__name__ == "PortArgs"}.values():
            remove(start_files(ports))
        loop.close()
        if previous_sigquit is not None:
            signal.signal(signal.SIGQUIT, previous_sigquit)
        if isinstance(e, Exception):
            raise EngineStartError(f"SGLang engine failed to start: {e}") from e
        raise
    finally:
        asyncio.set_event_loop(None)
        if saved_env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved_env
    atexit.unregister(engine.shutdown)  # it would kill every child of this process at exit
    return engine, loop, spec, hf_config, bool(memory_saver), previous_sigquit


def kill_sglang(pids: list[int], processes: list) -> None:
    """SIGKILL SGLang's processes and their descendants; reap the direct children we hold."""
    import psutil

    victims = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            victims += proc.children(recursive=True) + [proc]
        except psutil.NoSuchProcess:
            pass
    for proc in victims:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    # multiprocessing.Process objects: join reaps them the way multiprocessing expects
    for p in processes:
        p.join(10)
    held = {p.pid for p in processes}
    psutil.wait_procs([v for v in victims if v.pid not in held], timeout=10)


def _frame_locals(tb) -> list[object]:
    """The local variables of each frame an exception passed through."""
    found: list[object] = []
    while tb is not None:
        found += tb.tb_frame.f_locals.values()
        tb = tb.tb_next
    return found


def close_zmq(*owners: object) -> None:
    """Close every ZeroMQ context behind the sockets these objects (and their attributes) hold,
    linger 0."""
    import zmq

    contexts, seen = [], set()
    todo = [(o, 0) for o in owners]
    while todo:
        obj, depth = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, zmq.Socket | zmq.Context):
            ctx = obj if isinstance(obj, zmq.Context) else obj.context
            if ctx not in contexts:
                contexts.append(ctx)
            continue
        if depth < 2 and hasattr(obj, "__dict__") and not isinstance(obj, type):
            todo += [(v, depth + 1) for v in vars(obj).values()]
    for ctx in contexts:
        try:
            ctx.destroy(linger=0)
        except zmq.ZMQError:
            pass


def is_sglang(proc) -> bool:
    """A process that SGLang started: not multiprocessing's resource tracker or fork server, this
    process's children that may start meanwhile (SGLang's own fork from the latter)."""
    try:
        helper = proc.ppid() == os.getpid() and any(
            name in " ".join(proc.cmdline()) for name in ("resource_tracker", "forkserver")
        )
    except Exception:  # noqa: BLE001 - already gone
        return False
    return not helper


def proc_name(proc) -> str:
    try:
        return proc.name()
    except Exception:  # noqa: BLE001 - already gone
        return "process"
