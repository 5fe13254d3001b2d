"""The engine's own process: a loop that interleaves trainer commands with engine steps.

Commands arrive on a torch.multiprocessing queue (tensors travel as shared-memory handles);
results go back on a one-way pipe whose only writer is this process, so the trainer side sees EOF
the moment this process dies. Between two steps the loop drains every queued command, so a
control call waits at most one step (plus its own work), and a burst of `generate` calls is
admitted together.

Messages in:  ("generate", rid, (prompt_ids, sampling, slot))  |  ("call", cid, (method, args))
Messages out: ("ready", None, EngineInfo) | ("startup_error", None, exc) | ("done", rid, Completion)
              | ("failed", rid, exc) | ("reply", cid, value) | ("error", cid, exc) | ("crash", None, text)
"""

from __future__ import annotations

import os
import queue
import signal
import traceback
from multiprocessing import parent_process
from multiprocessing.connection import Connection

import torch

from orbit.engine.base import EngineError, EngineInfo
from orbit.engine.embedded.engine import EngineCore, EngineOptions

# Control calls the trainer side may invoke by name (anything else is refused).
CALLS = frozenset({"load_adapter", "activate", "pause_generation", "flush_cache", "continue_generation",
                   "update_weights", "release_memory", "resume_memory", "stats", "shutdown"})
_MAX_COMMANDS_PER_STEP = 512  # keeps a flood of submissions from starving the decode loop
_IDLE_POLL_S = 0.5


def engine_main(model_path: str, options: EngineOptions, threads: int, commands, out: Connection) -> None:
    """Process entry point (spawned)."""
    # Ctrl-C reaches the whole process group: the trainer handles it and shuts us down cleanly.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)  # before any op: generation and training share the cores
    try:
        core = EngineCore(model_path, options)
    except BaseException as e:  # noqa: BLE001 - reported to the caller, which raises it
        out.send(("startup_error", None, e if isinstance(e, EngineError) else EngineError(repr(e))))
        return
    spec = core.spec
    out.send(("ready", None, EngineInfo(os.getpid(), spec.model_type, spec.vocab_size, core.max_context,
                                        spec.eos_token_ids, spec.num_layers, options.device, options.dtype)))
    try:
        _serve(core, commands, out)
    except BaseException:  # noqa: BLE001 - a bug in the engine: tell the client, then die
        out.send(("crash", None, traceback.format_exc()))
        raise


def _serve(core: EngineCore, commands, out: Connection) -> None:
    parent = parent_process()
    while True:
        for msg in _drain(commands, block=not core.has_work()):
            if not _handle(core, msg, out):
                return
        if parent is not None and not parent.is_alive():
            return  # the trainer is gone; nobody will read our results
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
