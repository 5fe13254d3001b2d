"""Telling a slow engine from a hung one (docs/design.md §8), for the pool's monitor.

An engine is alive while it makes progress or answers: its heartbeat moves (a count its own loop
advances as it works, model layers included, read without waiting for that loop), or a ping
(`stats`) comes back. One that does neither for `timeout_s` is hung. Neither sign is enough alone: a
long step (a big prefill on a CPU) holds every answer until it ends, and an engine with nothing to
do may sleep between its heartbeats.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

from orbit.engine.base import Engine, EngineDeadError


def _ask(call) -> Future[float]:
    """`call()` in a daemon thread (a hung engine may never answer); the future holds the
    time.monotonic() of its answer."""
    fut: Future[float] = Future()

    def run() -> None:
        try:
            call()
            fut.set_result(time.monotonic())
        except BaseException as err:  # noqa: BLE001 - handed back through the future
            fut.set_exception(err)

    threading.Thread(target=run, name="orbit-ping", daemon=True).start()
    return fut


class Liveness:
    """One engine's signs of life; `check` it about once a second."""

    def __init__(self, engine: Engine, timeout_s: float, now: float) -> None:
        self.engine = engine
        self.timeout_s = timeout_s
        self.seen = now  # when it last moved or answered
        self.beat = engine.heartbeat()
        self.ping: Future[float] | None = None  # one at a time: a slow step holds it
        self._beat_at_ping = self.beat
        self._ping_at = now

    def check(self, now: float) -> str | None:
        """None while the engine is alive; why it is not (it died, or it is hung)."""
        beat = self.engine.heartbeat()
        if beat is not None and beat != self.beat:
            self.beat, self.seen = beat, now
        if self.ping is not None and self.ping.done():
            err = self.ping.exception()
            # a call's own bound (a client's call_timeout_s) can run out in a step that progresses;
            # an answer that fails at once (a client that knows its engine is gone) is death
            bounded = now - self._ping_at >= self.timeout_s and self.beat != self._beat_at_ping
            if isinstance(err, EngineDeadError) and not bounded:
                return str(err)
            if err is None:
                self.seen = max(self.seen, self.ping.result())
            self.ping = None  # another error says nothing of its life: ask again
        if self.ping is None:
            self.ping, self._beat_at_ping, self._ping_at = _ask(self.engine.stats), self.beat, now
        if now - self.seen >= self.timeout_s:
            return f"neither answered nor made progress for {now - self.seen:.1f} s (hung)"
        return None
