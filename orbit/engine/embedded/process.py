"""The embedded engine in a process of its own: the client the trainer side holds, and the loop that
runs in the engine's process. The two ends of one protocol, in one place.

Trainer side (`EmbeddedClient`, the Engine protocol): thread-safe; a producer thread calls
`generate` while the trainer thread makes control calls. `generate` returns a Future at once;
control calls block until the engine has done them. One reader thread resolves futures from the
engine's pipe; it polls with a timeout and checks the process, so if the engine dies every pending
future and every later call raises EngineDeadError within about a second instead of hanging.

Engine side (`engine_main`): a loop that interleaves commands with engine steps. Commands arrive on
a torch.multiprocessing queue (tensors travel as shared-memory handles); results go back on a
one-way pipe whose only writer is the engine process, so the trainer side sees EOF the moment it
dies. Between two steps the loop drains every queued command, so a control call waits at most one
step (plus its own work), and a burst of `generate` calls is admitted together.

Messages in:  ("generate", rid, (prompt_ids, sampling, slot))  |  ("call", cid, (method, args))
Messages out: ("ready", None, EngineInfo) | ("startup_error", None, exc)
              | ("done", rid, Completion) | ("failed", rid, exc) | ("reply", cid, value)
              | ("error", cid, exc) | ("crash", None, text)
"""

from __future__ import annotations

import itertools
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing import parent_process
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from orbit.engine.base import (
    ACTIVE,
    Capabilities,
    Completion,
    EngineDeadError,
    EngineError,
    EngineInfo,
    EngineStartError,
    EngineStats,
    PauseMode,
    SamplingParams,
    Slot,
    resolve,
)
from orbit.engine.checks import check_pause_mode, check_prompt, check_request_slot, plain_config
from orbit.engine.embedded.engine import EngineCore, EngineOptions
from orbit.host.forks import adopt_env, child_env, forked_from_server, name_process

_POLL_S = 0.2
_STARTUP_TIMEOUT_S = 600.0
# Control calls wait for one engine step plus their own work (milliseconds to seconds); an engine
# that stays silent this long is hung (e.g. stopped), not busy.
CALL_TIMEOUT_S = 300.0
_SHUTDOWN_TIMEOUT_S = 5.0


def start_embedded_engine(
    model_path: str | Path,
    *,
    max_running: int = 32,
    max_context: int | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    threads: int = 1,
    seed: int = 0,
    prefix_cache_size: int = 64,
    max_prefill_tokens: int = 4096,
    call_timeout_s: float = CALL_TIMEOUT_S,
    slots: int = 2,
    lend_min_work: float = EngineOptions.lend_min_work,
) -> EmbeddedClient:
    """Spawn the engine process on a Hugging Face checkpoint directory and return its client.

    `call_timeout_s`: a control call unanswered this long means the engine is hung
    (EngineDeadError). `slots`: adapter slots. `lend_min_work`: EngineOptions'."""
    options = EngineOptions(
        max_running=max_running,
        max_context=max_context,
        dtype=dtype,
        device=device,
        seed=seed,
        prefix_cache_size=prefix_cache_size,
        max_prefill_tokens=max_prefill_tokens,
        slots=slots,
        lend_min_work=lend_min_work,
    )
    ctx = forked_from_server([__name__])  # torch and the engine imported once, not per engine
    commands = ctx.Queue()
    reader, writer = ctx.Pipe(duplex=False)
    beat = ctx.RawValue("Q", 0)  # the engine's heartbeat, in shared memory (no file left behind)
    lent = ctx.RawValue("i", 0)  # threads the trainer lends while it waits (lend_threads)
    process = ctx.Process(
        target=engine_main,
        args=(str(model_path), options, threads, commands, writer, beat, lent, child_env()),
        daemon=True,
        name="orbit-engine",
    )
    process.start()
    writer.close()  # the engine must hold the only writer, so its death reads as EOF here
    deadline = time.monotonic() + _STARTUP_TIMEOUT_S
    try:
        while not reader.poll(_POLL_S):
            if not process.is_alive() or time.monotonic() > deadline:
                raise EngineStartError(
                    f"engine process failed to start (exit code {process.exitcode})"
                )
        kind, _, payload = reader.recv()
    except (EOFError, OSError) as e:
        process.join(5)
        raise EngineStartError(
            f"engine process failed to start (exit code {process.exitcode})"
        ) from e
    if kind != "ready":
        process.join(5)
        raise payload
    return EmbeddedClient(process, commands, reader, payload, slots, call_timeout_s, beat, lent)


class EmbeddedClient:
    """Implements orbit.engine.base.Engine for the engine process."""

    adapter_transport = "shared-memory"  # tensors cross to the engine process through shared memory

    def __init__(
        self,
        process,
        commands,
        results,
        info: EngineInfo,
        slots: int,
        call_timeout_s: float = CALL_TIMEOUT_S,
        beat=None,
        lent=None,
    ) -> None:
        self.info = info
        # Everything a push may ask of it: OFT slots, loads under paused requests, flush at any
        # time.
        self.capabilities = Capabilities(
            slots=slots, oft_slots=True, loads_while_paused=True, flush_while_running=True
        )
        self.call_timeout_s = call_timeout_s
        self._beat = beat  # a shared ctypes counter the engine's loop advances
        self._lent = lent  # a shared ctypes int the engine's loop reads before each step
        self._process = process
        self._commands = commands
        self._results = results
        self._pending: dict[int, tuple[Future, dict | None]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._dead: EngineDeadError | None = None
        self._closing: str | None = None  # why the process is being stopped (shut down, killed)
        self._reader = threading.Thread(target=self._read, name="orbit-engine-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.info.pid

    # ---- plumbing ------------------------------------------------------------------------------

    def _submit(self, kind: str, payload: tuple, meta: dict | None = None) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(str(self._dead))
            key = next(self._ids)
            self._pending[key] = (fut, meta)
            # under the lock: a dying reader cannot miss this future
            self._commands.put((kind, key, payload))
        return fut

    def _call(self, method: str, *args: object, timeout: float | None = None) -> object:
        timeout = self.call_timeout_s if timeout is None else timeout
        fut = self._submit("call", (method, args))
        try:
            return fut.result(timeout)
        except TimeoutError:
            fut.cancel()
            raise EngineDeadError(
                f"engine process {self.pid} did not answer {method} within {timeout:g} s (alive: "
                f"{self._process.is_alive()}); it is hung"
            ) from None

    def _read(self) -> None:
        try:
            while True:
                if self._results.poll(_POLL_S):
                    kind, key, payload = self._results.recv()
                    self._dispatch(kind, key, payload)
                elif not self._process.is_alive():
                    raise EOFError
        except (EOFError, OSError):
            self._process.join(2)
            self._fail_all(
                EngineDeadError(
                    self._closing
                    or f"engine process {self.pid} died (exit code {self._process.exitcode})"
                )
            )
        except EngineDeadError as e:
            self._fail_all(e)
        except BaseException as e:  # noqa: BLE001 - whatever broke, no caller may hang on it
            self._fail_all(EngineDeadError(f"engine client reader failed: {e!r}"))

    def _dispatch(self, kind: str, key: int | None, payload: object) -> None:
        if kind == "crash":
            raise EngineDeadError(f"engine process {self.pid} crashed:\n{payload}")
        with self._lock:
            fut, meta = self._pending.pop(key)  # type: ignore[arg-type]
        if kind == "done":  # meta never crossed the process: hand back the caller's own object
            payload.meta = meta if meta is not None else {}  # type: ignore[attr-defined]
        if kind in ("done", "reply"):
            resolve(fut, payload)
        else:  # "failed" / "error"
            resolve(fut, exc=payload)  # type: ignore[arg-type]

    def _fail_all(self, error: EngineDeadError) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = error
            pending, self._pending = self._pending, {}
        # nobody reads the command queue any more: do not let its feeder thread block exit
        self._commands.cancel_join_thread()
        for fut, _ in pending.values():
            resolve(fut, exc=self._dead)

    def _shared(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One copy into fresh shared memory; the queue then moves only handles.

        A copy, not `share_memory_()` on the caller's tensors: that would move the trainer's live
        parameters into shared memory. CUDA tensors for a CUDA engine go by CUDA IPC as they are
        (the call blocks until the engine has copied them).
        """
        if not isinstance(tensors, dict):
            raise EngineError(
                f"tensors must be a dict of name -> tensor, got {type(tensors).__name__}"
            )
        out = {}
        for name, t in tensors.items():
            if isinstance(t, torch.Tensor):
                t = t.detach()
                if not (t.is_cuda and self.info.device.startswith("cuda")):
                    t = torch.empty(t.shape, dtype=t.dtype).share_memory_().copy_(t)
            out[name] = t
        return out

    # ---- the Engine protocol -------------------------------------------------------------------

    def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        slot: Slot = ACTIVE,
        meta: dict | None = None,
    ) -> Future[Completion]:
        """Submit one request. Bad arguments raise EngineError here; an empty slot or a token id
        outside the vocabulary fails the future with EngineError."""
        if not isinstance(sampling, SamplingParams):
            raise EngineError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        sampling.check()
        prompt = check_prompt(prompt_ids, self.info.vocab_size, self.info.max_context)
        check_request_slot(slot, self.capabilities.slots)
        return self._submit("generate", (prompt, sampling, slot), meta)

    def load_adapter(
        self, slot: int, tensors: dict[str, torch.Tensor], adapter_config: dict, version: int
    ) -> float:
        # peft's enums and sets do not cross the process as themselves
        config = plain_config(adapter_config)
        return self._call("load_adapter", slot, self._shared(tensors), config, version)  # type: ignore[return-value]

    def activate(self, slot: int | None) -> None:
        self._call("activate", slot)

    def pause_generation(self, mode: PauseMode = "in_place") -> None:
        self._call("pause_generation", check_pause_mode(mode))

    def flush_cache(self) -> None:
        self._call("flush_cache")

    def continue_generation(self) -> None:
        self._call("continue_generation")

    def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        self._call("update_weights", self._shared(tensors), version)

    def release_memory(self) -> None:
        self._call("release_memory")

    def resume_memory(self) -> None:
        self._call("resume_memory")

    def stats(self, timeout: float | None = None) -> EngineStats:
        return self._call("stats", timeout=timeout)  # type: ignore[return-value]

    def heartbeat(self) -> int | None:
        """The engine loop's turns and model layers run so far (it moves through a long prefill,
        which answers no call until it ends)."""
        return None if self._beat is None else int(self._beat.value)

    def lend_threads(self, n: int) -> None:
        """From the engine's next step on, compute on `n` more torch threads (0: its own only). A
        write to shared memory: the call neither waits for the engine nor fails if it is gone."""
        if self._lent is not None:
            self._lent.value = max(0, int(n))

    def shutdown(self) -> None:
        """Abort what is in flight, stop the process (killed if it does not stop: a hung or stopped
        process must not hold the caller). Idempotent."""
        self._closing = self._closing or "engine was shut down"
        try:
            self._call("shutdown", timeout=_SHUTDOWN_TIMEOUT_S)
        except EngineDeadError:
            pass
        self._process.join(_SHUTDOWN_TIMEOUT_S)
        if self._process.is_alive():
            self._process.kill()  # SIGKILL: a SIGSTOPped process ignores SIGTERM until continued
            self._process.join(_SHUTDOWN_TIMEOUT_S)
        self._fail_all(EngineDeadError("engine was shut down"))
        self._commands.close()

    def kill(self) -> None:
        """Stop a dead or hung engine at once (SIGKILL), without asking it first."""
        self._closing = self._closing or "engine was killed"
        if self._process.is_alive():
            self._process.kill()
        self._process.join(_SHUTDOWN_TIMEOUT_S)
        self._fail_all(EngineDeadError("engine was killed"))

    def __enter__(self) -> EmbeddedClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


# ---- the engine's process ----------------------------------------------------------------------

# Control calls the trainer side may invoke by name (anything else is refused).
CALLS = frozenset(
    {
        "load_adapter",
        "activate",
        "pause_generation",
        "flush_cache",
        "continue_generation",
        "update_weights",
        "release_memory",
        "resume_memory",
        "stats",
        "shutdown",
    }
)
_MAX_COMMANDS_PER_STEP = 512  # keeps a flood of submissions from starving the decode loop
_IDLE_POLL_S = 0.5


def engine_main(
    model_path: str,
    options: EngineOptions,
    threads: int,
    commands,
    out: Connection,
    beat=None,
    lent=None,
    env: dict[str, str] | None = None,
) -> None:
    """Process entry point (forked from the fork server, orbit/host/forks.py)."""
    if env is not None:
        adopt_env(env)
    name_process("orbit-engine")
    # The trainer stops the engine itself, after what a Ctrl-C or a launcher's SIGTERM to its
    # process group makes it save; the engine leaves that group (and ignores a Ctrl-C sent to it
    # before it has).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.setpgid(0, 0)
    torch.set_num_threads(threads)  # before any op: generation and training share the cores
    try:
        core = EngineCore(model_path, options)
    except BaseException as e:  # noqa: BLE001 - reported to the caller, which raises it
        out.send(("startup_error", None, e if isinstance(e, EngineError) else EngineError(repr(e))))
        return
    spec = core.spec
    out.send(
        (
            "ready",
            None,
            EngineInfo(
                os.getpid(),
                spec.model_type,
                spec.vocab_size,
                core.max_context,
                spec.eos_token_ids,
                spec.num_layers,
                options.device,
                options.dtype,
            ),
        )
    )
    tick = _ticker(beat)
    core.decoder.on_layer = tick
    try:
        _serve(core, commands, out, tick, _threads(core, threads, lent))
    except BaseException:  # noqa: BLE001 - a bug in the engine: tell the client, then die
        out.send(("crash", None, traceback.format_exc()))
        raise


def _ticker(beat) -> Callable[[], None]:
    """Advance the heartbeat the client reads (one writer: this process's loop)."""
    if beat is None:
        return lambda: None

    def tick() -> None:
        beat.value += 1

    return tick


def _threads(core: EngineCore, own: int, lent) -> Callable[[], None]:
    """Before each step: the engine's own torch threads, plus those the trainer lends while it
    waits for a batch (`lend_threads`) when the step has the work to share (EngineOptions).
    Only this loop's thread computes, so it sets its own count (orbit/host/threads.py); a step is
    tens of ms, so a core given back is free again that soon."""
    if lent is None:
        return lambda: None

    def apply() -> None:
        worth = core.step_work() >= core.options.lend_min_work
        want = own + (lent.value if worth else 0)
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)

    return apply


def _serve(
    core: EngineCore,
    commands,
    out: Connection,
    tick: Callable[[], None],
    threads: Callable[[], None],
) -> None:
    parent = parent_process()
    while True:
        tick()
        for msg in _drain(commands, block=not core.has_work()):
            if not _handle(core, msg, out):
                return
        if parent is not None and not parent.is_alive():
            return  # the trainer is gone; nobody will read our results
        threads()
        core.step()
        _send_finished(core, out)


def _drain(commands, block: bool) -> list:
    msgs = []
    try:
        msgs.append(commands.get(timeout=_IDLE_POLL_S) if block else commands.get_nowait())
        while len(msgs) < _MAX_COMMANDS_PER_STEP:
            msgs.append(commands.get_nowait())
    except queue.Empty:
        pass
    return msgs


def _send_finished(core: EngineCore, out: Connection) -> None:
    for rid, completion in core.pop_finished():
        out.send(("done", rid, completion))


def _handle(core: EngineCore, msg: tuple, out: Connection) -> bool:
    """Run one command; return False when the loop should end (shutdown)."""
    kind, key, payload = msg
    if kind == "generate":
        prompt_ids, sampling, slot = payload
        try:
            core.submit(prompt_ids, sampling, slot, rid=key)
        except Exception as e:  # noqa: BLE001 - bad input must not take the engine down
            out.send(("failed", key, _as_engine_error(e, "generate")))
        return True
    method, args = payload
    try:
        if method not in CALLS:
            raise EngineError(f"unknown engine call {method!r}")
        result = getattr(core, method)(*args)
    except Exception as e:  # noqa: BLE001 - calls validate before they change state; keep serving
        _send_finished(core, out)
        out.send(("error", key, _as_engine_error(e, method)))
        return True
    # completions a call produced (aborts) go out before its reply, so they are resolved
    # by the time the caller's control call returns
    _send_finished(core, out)
    out.send(("reply", key, result))
    return method != "shutdown"


def _as_engine_error(e: Exception, what: str) -> EngineError:
    if isinstance(e, EngineError):
        return e
    return EngineError(f"{what} failed: {type(e).__name__}: {e}")
