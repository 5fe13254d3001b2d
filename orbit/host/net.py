"""Ports on this machine: what Orbit's servers (the SGLang servers it starts, the episode endpoint,
the live page) and the trainer ranks' rendezvous listen on."""

from __future__ import annotations

import socket
import threading
from typing import Any


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now (the OS picks it; a race with another process is possible but
    rare)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ThreadServer:
    """An ASGI app (FastAPI) served by uvicorn on a thread of this process: the episode endpoint,
    the live page. `start` returns once it listens, or raises OSError saying why not (a port
    taken)."""

    def __init__(
        self, app, host: str = "127.0.0.1", port: int | None = None, name: str = "orbit-server"
    ) -> None:
        self.app, self.host, self.name = app, host, name
        self.port = port or free_port(host)
        self._server: Any = None  # uvicorn.Server, once started
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 30.0) -> ThreadServer:
        import time

        import uvicorn

        # uvicorn would log a taken port and exit(3): say why here instead
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((self.host, self.port))
            except OSError as err:
                raise OSError(
                    f"{self.name} cannot listen on {self.host}:{self.port}: {err.strerror}"
                ) from None

        # A stop waits at most a second for requests still open (an agent's call waiting on an
        # engine that is going too): they are cut, not waited for.
        config = uvicorn.Config(
            self.app,
            host=self.host,
            port=self.port,
            log_level="critical",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=1,
        )
        server = self._server = uvicorn.Server(config)
        failed: list[BaseException] = []

        def run() -> None:
            try:
                server.run()
            # said by start(), not printed from a thread
            except BaseException as err:  # noqa: BLE001
                failed.append(err)

        thread = self._thread = threading.Thread(target=run, name=self.name, daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if not thread.is_alive():
                why = f": {failed[0]}" if failed else " (is the port taken?)"
                raise OSError(f"{self.name} could not listen on {self.host}:{self.port}{why}")
            if time.monotonic() > deadline:
                self.stop()
                raise OSError(
                    f"{self.name} did not start on {self.host}:{self.port} within {timeout_s:g} s"
                )
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
            if self._thread.is_alive():  # a daemon thread: it goes with the process, but say so
                import sys

                sys.stderr.write(
                    f"warning: {self.name} on {self.host}:{self.port} did not stop within 10 s\n"
                )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"
