"""The SGLang engine's event loop and liveness: every call to SGLang is a coroutine run on one
asyncio loop in a thread of its own; a watchdog polls the transport's liveness (the in-process
engine's child processes, a server's process and `/health`). Once SGLang is gone every pending
future and every later call fails with EngineDeadError, and every request's future is answered on
every path (a reply that cannot be read, a cancellation, a bug): a caller never waits on a request
that has left SGLang.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Future
from typing import Any

from orbit.engine.base import EngineDeadError, EngineError, resolve

POLL_S = 0.2


class EngineLoop:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        dead: Callable[[], Coroutine[Any, Any, str | None]],
        label: str,
        liveness_s: float = POLL_S,
    ) -> None:
        """`dead()`: the transport's liveness probe (why SGLang is gone, or None). `label` names the
        engine in errors."""
        self.label = label
        self._loop = loop
        self._probe_dead = dead
        self._liveness_s = liveness_s
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[Future, concurrent.futures.Future]] = {}
        self._ids = itertools.count()
        self.dead: EngineDeadError | None = None
        self.closed = False
        self._closing = threading.Event()  # wakes the watchdog at shutdown
        # the watchdog's liveness probe in flight
        self._probe: concurrent.futures.Future | None = None
        self._thread = threading.Thread(target=self._run, name="orbit-sglang-loop", daemon=True)
        self._thread.start()
        self._watchdog = threading.Thread(
            target=self._watch, name="orbit-sglang-watchdog", daemon=True
        )
        self._watchdog.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))

    def call(self, coro):
        """Run a coroutine on the loop and wait for it; EngineDeadError if SGLang dies meanwhile."""
        if self.dead is not None:
            coro.close()
            raise EngineDeadError(str(self.dead))
        return self.wait(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def wait(self, fut):
        """A result, with the engine's liveness checked while waiting (never forever)."""
        while True:
            try:
                return fut.result(POLL_S)
            except concurrent.futures.CancelledError:
                # shutdown cancels the loop's calls (a lost engine is shut down while an updater
                # still talks to it): the caller must hear that the engine is gone, not a bare
                # CancelledError
                raise EngineDeadError(str(self.dead or f"{self.label} was shut down")) from None
            except concurrent.futures.TimeoutError:
                if self.dead is not None and not fut.done():
                    fut.cancel()
                    raise EngineDeadError(str(self.dead)) from None

    def submit(self, make_coro: Callable[[], Awaitable[None]], fut: Future) -> Future:
        """Run `make_coro()` on the loop for the caller's `fut`, which is answered however it
        ends."""

        async def guarded(key: int) -> None:
            try:
                await make_coro()
            except asyncio.CancelledError:
                resolve(fut, exc=self.dead or EngineDeadError(f"{self.label} was shut down"))
                raise
            except EngineError as e:
                resolve(fut, exc=e)
            except Exception as e:  # noqa: BLE001 - whatever broke, the caller hears of it
                resolve(
                    fut,
                    exc=self.dead
                    or EngineError(
                        f"{self.label}: SGLang's reply could not be read: {type(e).__name__}: {e}"
                    ),
                )
            finally:
                with self._lock:
                    self._pending.pop(key, None)
            # no-op if answered
            resolve(fut, exc=EngineError("internal error: a request ended without an answer"))

        with self._lock:
            if self.dead is not None:
                raise EngineDeadError(str(self.dead))
            key = next(self._ids)
            task = asyncio.run_coroutine_threadsafe(guarded(key), self._loop)
            self._pending[key] = (fut, task)
        return fut

    def _watch(self) -> None:
        """Fail everything pending once the transport says SGLang is gone."""
        while not self._closing.wait(self._liveness_s):
            self._probe = asyncio.run_coroutine_threadsafe(self._probe_dead(), self._loop)
            try:
                reason = self._probe.result(30)
            # a probe that could not run (or was cancelled) says nothing
            except BaseException:  # noqa: BLE001
                reason = None
            if self.closed:
                return
            if reason:
                self.die(EngineDeadError(f"{self.label}: {reason}"))
                return

    def die(self, error: EngineDeadError) -> None:
        with self._lock:
            if self.dead is None:
                self.dead = error
            pending, self._pending = list(self._pending.values()), {}
        for fut, task in pending:
            resolve(fut, exc=self.dead)
            task.cancel()

    def close(self, last: Callable[[], Awaitable[None]]) -> bool:
        """Fail what is pending, cancel the loop's tasks, run `last()` on the loop (what the
        transport must release there), stop the loop. False when it was closed already."""
        with self._lock:
            if self.closed:
                return False
            self.closed = True
        self.die(EngineDeadError(f"{self.label} was shut down"))
        self._closing.set()
        if self._probe is not None:
            self._probe.cancel()
        self._watchdog.join(2)

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=2)
            await last()

        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(cancel_all(), self._loop).result(5)
            except Exception:  # noqa: BLE001 - shutting down regardless
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()
        return True
