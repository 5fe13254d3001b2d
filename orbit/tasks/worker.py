"""A worker process whose every answer is bounded in time: what a task runs when the code it calls
may hang or burn a core (math-verify's sympy, a reasoning-gym generator), in a process of Orbit's
own.

One request at a time (thread-safe). A request that does not come back within its time is cut by
killing the process, which starts again for the next request; the caller gets ("timeout", None). The
process exits by itself once Orbit is gone (it watches its parent).
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

PARENT_POLL_S = 1.0
START_TIMEOUT_S = 120.0  # importing sympy on a loaded 2-core machine


class Worker:
    """`serve(conn, *args)` in a spawned process: it sends "ready", then answers each request it
    receives with one message, and returns when `conn` closes or its parent is gone
    (`serve_requests`)."""

    def __init__(self, serve: Callable, args: tuple, name: str, timeout_s: float) -> None:
        self.serve, self.args, self.name, self.timeout_s = serve, args, name, timeout_s
        self._lock = threading.Lock()
        self._proc: mp.process.BaseProcess | None = None
        self._conn: Connection | None = None

    def ask(self, request: object, timeout_s: float | None = None) -> tuple[str, Any]:
        """The worker's answer to `request` (whatever its serve function sends); ("timeout", None)
        when none came in time, ("error", why) when the process died."""
        with self._lock:
            if self._proc is None or self._conn is None or not self._proc.is_alive():
                self._proc, self._conn = self._start()
            proc, conn = self._proc, self._conn
            conn.send(request)
            if conn.poll(timeout_s or self.timeout_s):
                try:
                    return conn.recv()
                # it died (killed for memory, a crash in the code it runs): not a timeout
                except EOFError:
                    proc.join(5)
                    code = proc.exitcode
                    self._stop()
                    return "error", f"the {self.name} process exited (exit code {code})"
            self._stop()  # stuck: the next request gets a fresh process
            return "timeout", None

    def _start(self) -> tuple[mp.process.BaseProcess, Connection]:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=self.serve, args=(child, *self.args), name=self.name, daemon=True)
        proc.start()
        child.close()
        self._proc, self._conn = proc, parent
        try:
            ready = parent.poll(START_TIMEOUT_S) and parent.recv() == "ready"
        except EOFError:
            ready = False
        if not ready:
            code = proc.exitcode
            self._stop()
            raise RuntimeError(f"the {self.name} process did not start (exit code {code})")
        return proc, parent

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None

    def close(self) -> None:
        with self._lock:
            self._stop()


def serve_requests(conn: Connection, answer: Callable[[Any], object]) -> None:
    """The worker's loop: Ctrl-C ignored (the trainer's to handle), "ready" sent, then `answer` for
    each request until the connection closes or the parent process is gone."""
    import signal
    from multiprocessing import parent_process

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn.send("ready")
    parent = parent_process()
    while True:
        if not conn.poll(PARENT_POLL_S):
            if parent is not None and not parent.is_alive():
                return
            continue
        try:
            request = conn.recv()
        except EOFError:
            return
        conn.send(answer(request))
