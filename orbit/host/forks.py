"""Processes Orbit starts from Python, forked from a fork server that has imported what they run.

A spawned process is a fresh interpreter that imports torch and Orbit again: about 1.5 s of a core
for every engine process here, paid again by each engine of a pool, a sweep or a bench and by each
engine brought back (and 7-9 s for each of an in-process SGLang engine's two processes, which
import SGLang). multiprocessing's fork server is one single-threaded process per Orbit process that
imports them once; each process it forks starts with them imported, and no thread of the
trainer's is forked with it. The server ignores Ctrl-C and ends when the process that started it
ends (it watches a pipe of that process's), taking nothing with it but what it forked.

What the server imports is fixed when it starts, with the first process forked from it: `preload`
adds modules before then. A forked process starts with the server's environment, the one its
start saw: what it runs applies the starting process's own (`child_env`, `adopt_env`), as a
spawned one would have it.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import sys
import tempfile
from multiprocessing import forkserver
from multiprocessing.context import ForkServerContext

_PR_SET_NAME = 15  # prctl(2)
_preload: list[str] = []


def preload(modules: list[str]) -> None:
    """Have the fork server import `modules` when it starts (once it runs, what it forks imports
    them itself)."""
    _preload.extend(m for m in modules if m not in _preload)
    mp.get_context("forkserver").set_forkserver_preload(list(_preload))


def forked_from_server(modules: list[str]) -> ForkServerContext:
    """The context whose processes fork from this process's fork server (started now if it is not
    running, importing `modules` and what `preload` added).

    The server starts with SIGQUIT blocked, which it and what it forks keep: SGLang's processes
    send SIGQUIT to their parent when they fail, and the server dying of it would take every SGLang
    process forked from it along (they ask the kernel to kill them when their parent dies)."""
    preload(modules)
    ctx = mp.get_context("forkserver")
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGQUIT})
    try:
        forkserver.ensure_running()  # a server that died is started again
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return ctx


def child_env() -> dict[str, str]:
    """This process's environment, for the process it starts to adopt."""
    return dict(os.environ)


def adopt_env(env: dict[str, str]) -> None:
    """Take the starting process's environment (in a forked process, first thing)."""
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # TMPDIR again, as the starting process has it


def name_process(name: str) -> None:
    """The name `ps`, `top` and psutil show for this process (at most 15 bytes on Linux): a forked
    process otherwise shows the fork server's command line."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
