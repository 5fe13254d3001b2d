"""Engines that come back (docs/design.md §8): a long run does not slowly lose its fleet.

When a member leaves the pool (it died, or stopped answering and was killed), the pool calls
`Revival.lost`. One thread per lost member then brings it back:
- an engine Orbit started is started again, up to `tries` times, waiting 1, 2, 4 ... s (at most
  MAX_BACKOFF_S) before each try; one that dies again within STEADY_S of coming back goes on with
  the tries left, so that an engine that cannot stay up is given up;
- an attached server is polled every `poll_s`: once it answers again it goes through the same
  checks as at start (health, version, model, LoRA settings; orbit/engine/sglang/server.py). It is
  given up once no engine has been serving for `wait_s` (the run's stall bound): the run then stops,
  as it would have without comebacks.
Before an engine serves again, the push brings it to the newest snapshot (`FleetPush.bring_up`),
and only then does it `rejoin` the pool, so that no request of it ever sees an older policy than
admission allowed. A restart that fails is reported on the console and in run.log.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from orbit.engine.base import Engine
from orbit.engine.calls import quietly
from orbit.engine.pool import EnginePool, Member
from orbit.push.fleet import FleetPush

MAX_BACKOFF_S = 30.0
STEADY_S = 60.0  # an engine that dies sooner after coming back goes on using the same tries


class Revival:
    """Brings lost members of `pool` back: `restart(index)` starts (or re-attaches) engine
    `index`."""

    def __init__(
        self,
        pool: EnginePool,
        push: FleetPush,
        restart: Callable[[int], Engine],
        attached: bool,
        tries: int,
        wait_s: float,
        poll_s: float = 5.0,
        backoff_s: float = 1.0,
    ) -> None:
        self.pool, self.push, self.restart = pool, push, restart
        self.attached, self.tries, self.wait_s, self.poll_s = attached, tries, wait_s, poll_s
        self.backoff_s = backoff_s
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._tried: dict[int, int] = {}  # member index -> tries used since it was last steady
        pool.revive_with(self.lost)

    def lost(self, member: Member) -> None:
        if not member.joined_at or time.monotonic() - member.joined_at > STEADY_S:
            self._tried[member.index] = 0
        thread = threading.Thread(
            target=self._bring_back,
            args=(member,),
            name=f"orbit-revive-{member.index}",
            daemon=True,
        )
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def stop(self, seconds: float = 60.0) -> None:
        """No more comebacks; an engine still starting is stopped once it has (within `seconds`)."""
        self._stop.set()
        deadline = time.monotonic() + seconds
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _bring_back(self, member: Member) -> None:
        why = "it died again soon after coming back"
        while not self._stop.is_set():
            attempt = self._tried[member.index] = self._tried[member.index] + 1
            if not self.attached and attempt > self.tries:
                return self.pool.gave_up(member, f"not restarted after {self.tries} tries ({why})")
            if self.attached and self._nobody_serving_for() > self.wait_s:
                return self.pool.gave_up(
                    member, f"did not answer again within {self.wait_s:g} s ({why})"
                )
            pause = (
                self.poll_s
                if self.attached
                else min(MAX_BACKOFF_S, self.backoff_s * 2.0 ** (attempt - 1))
            )
            if self._stop.wait(pause):
                break
            try:
                self._try(member)
                # This thread lives as long as the engine it started: SGLang's processes die with
                # the thread that started them (PR_SET_PDEATHSIG fires when that thread exits).
                self._stop.wait()
                return
            except Exception as err:  # noqa: BLE001 - reported, and tried again
                why = f"{type(err).__name__}: {err}".splitlines()[0]
                # an attached server is expected to be down for a while: no noise
                if not self.attached:
                    self.pool.on_warning(
                        f"engine {member.index}: restart {attempt} of {self.tries} failed: {why}"
                    )
        self.pool.gave_up(member, "the run ended")

    def _try(self, member: Member) -> None:
        engine = self.restart(member.index)
        try:
            if self._stop.is_set():
                raise RuntimeError("the run ended")
            version = self.push.bring_up(member, engine)
            if not self.pool.rejoin(member, engine, version):
                raise RuntimeError("the run ended")
            self.push.rejoined(member)
        except BaseException:
            quietly(engine.kill)  # it never served: only its own processes go
            raise

    def _nobody_serving_for(self) -> float:
        """Seconds since the pool last had a live member (0 while one serves)."""
        return 0.0 if self.pool.alive() else time.monotonic() - self.pool.empty_since
