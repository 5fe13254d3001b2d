"""Ctrl-C that always ends a command the same way: one line, exit code 130, nothing half-written.

Python makes three things go wrong when Ctrl-C lands while big libraries import (which is most of
a command's first seconds):
- raised inside an import, KeyboardInterrupt can come out wrapped in that library's own error
  (pydantic's SchemaError, for one) or leave a module half-imported that fails later with another
  error: `caused_by_ctrl_c` looks down the chain and at whether a Ctrl-C was seen;
- raised inside a weakref callback (importlib's module locks use one) it is printed as "Exception
  ignored" and dropped, and the command would run on: the handler remembers every Ctrl-C, and
  `raise_if_dropped` raises it again at the next check;
- CPython 3.11 marks it as unhandled when it lands inside `exec` of a string (dataclasses build
  their methods so), and under `python -m` the process then kills itself with SIGINT at exit
  although the interrupt was handled: `handled` clears that mark.
Stdlib only, so the command line can install the import-time handler before anything heavy loads.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_seen = False
_previous_hook = sys.unraisablehook  # the hook _quiet_about_ctrl_c hands the rest on to


class Interrupted(Exception):
    """Ctrl-C: the run was saved (or, before its first step, nothing was left behind)."""

    def __init__(self, message: str, step: int = 0) -> None:
        super().__init__(message)
        self.step = step


def _exit_now(signum, frame) -> None:  # noqa: ARG001 - signal handler signature
    sys.stderr.write("interrupted: orbit did not start, nothing was trained\n")
    os._exit(130)


def exit_while_importing() -> None:
    """Until `catch_ctrl_c`, Ctrl-C exits at once: nothing has started, there is nothing to undo.
    A Ctrl-C that the shell told us to ignore (a background job) stays ignored."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _exit_now)


def _remember(signum, frame) -> None:  # noqa: ARG001 - signal handler signature
    global _seen
    _seen = True
    raise KeyboardInterrupt


def catch_ctrl_c() -> None:
    """Ctrl-C raises KeyboardInterrupt (even when started with SIGINT ignored) and is remembered;
    Python's "Exception ignored" report of a dropped one is left out (it is raised again
    instead)."""
    global _seen, _previous_hook
    _seen = False
    signal.signal(signal.SIGINT, _remember)
    if sys.unraisablehook is not _quiet_about_ctrl_c:
        _previous_hook = sys.unraisablehook
        sys.unraisablehook = _quiet_about_ctrl_c


@contextmanager
def remembered() -> Iterator[None]:
    """For the block, where this process still has Python's own Ctrl-C handler (a run started from
    Python, not the command line): Ctrl-C is remembered as `catch_ctrl_c` does, so that one Python
    drops (raised inside a weakref callback or a __del__) is raised again at the run's next step
    (`raise_if_dropped`). The handler before comes back after."""
    own = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if not own or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, _remember)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def catch_term() -> None:
    """SIGTERM too (a launcher stopping this rank 0 because another rank failed): the same as
    Ctrl-C."""
    signal.signal(signal.SIGTERM, _remember)


def stops_the_run(signum: int) -> bool:
    """Whether this signal stops a run here the way Ctrl-C does (so a step in progress holds it)."""
    return signum == signal.SIGINT or signal.getsignal(signum) is _remember


def _quiet_about_ctrl_c(unraisable: Any) -> None:
    if not isinstance(unraisable.exc_value, KeyboardInterrupt):
        _previous_hook(unraisable)


def raise_if_dropped() -> None:
    """Raise the Ctrl-C that Python printed and dropped, if there was one (one not `handled`
    yet)."""
    if _seen:
        raise KeyboardInterrupt


def handled() -> None:
    """The Ctrl-C seen so far has been dealt with (whoever catches KeyboardInterrupt says so)."""
    global _seen
    _seen = False
    _forget_cpython_mark()


def caused_by_ctrl_c(err: BaseException | None) -> bool:
    """An error that a Ctrl-C caused: one with KeyboardInterrupt down its chain, or any error after
    a Ctrl-C was seen (an import cut short can fail later with an unrelated-looking error, e.g. a
    RecursionError or a partially initialised module)."""
    if _seen:
        return True
    seen = 0
    while err is not None and seen < 20:
        if isinstance(err, KeyboardInterrupt):
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


def _forget_cpython_mark() -> None:
    """Clear CPython 3.11's unhandled-Ctrl-C mark where this Python has it."""
    try:
        ctypes.c_int.in_dll(ctypes.pythonapi, "_Py_UnhandledKeyboardInterrupt").value = 0
    except (ValueError, AttributeError):
        pass
