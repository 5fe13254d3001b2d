"""Pushing a new policy version to every engine of a pool (docs/design.md §8).

A push freezes the policy into a `Snapshot` (one copy, in the trainer's thread), then either
- `independent` (the default): hands it to one `Updater` thread per engine and returns. Each updater
  runs its engine's own phases (phases.py: e.g. load the ring slot, pause in place, activate,
  continue) as soon as it can; an engine still busy with version v when v+2 arrives skips to v+2
  (latest wins). No engine waits for another, and the trainer waits for none of them;
- `barrier` (for comparison, the peers' way): the same phases, each run on every engine at once
  (`run_phases` with the pool's fan-out), while the trainer waits.
Serial modes stay on-policy: the trainer waits until every live engine serves the new version
before the next batch is granted, whichever the flip.

A push an engine refuses (a bad adapter) leaves that engine serving what it had: with independent
flips the run warns and goes on, and stops only when one engine refuses REFUSALS_IN_A_ROW pushes in
a row; serial modes and the barrier stop at once (they need every engine on the new version).
An engine that comes back (orbit/run/revive.py) is `bring_up`-ed to the newest snapshot first.

`update_weights_s` is the time the trainer was held: the snapshot alone for independent flips.
The flip clock (when each version was pushed and when the last engine served it) lives here, where
the flips happen.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from orbit.engine.base import Engine, EngineDeadError, EngineError
from orbit.engine.pool import EnginePool, Member
from orbit.host.threads import helper_thread
from orbit.metrics.steps import Timeline
from orbit.push.phases import PolicySource, Push, PushResult, Target, make_push, run_phases

FLIPS = ("independent", "barrier")
REFUSALS_IN_A_ROW = 3  # an engine refusing this many pushes running is not a passing fault


@dataclass
class Snapshot:
    """One policy version, frozen: what the pushes read, while the trainer moves on."""

    version: int
    tensors: dict = field(default_factory=dict)  # an adapter push's
    config: dict = field(default_factory=dict)
    merged: dict[bool, dict] = field(default_factory=dict)  # only_adapted -> weights

    @classmethod
    def of(cls, policy: PolicySource, push: Push) -> Snapshot:
        """Copies exactly what `push` will read (adapter tensors, or merged weights)."""
        if push.full or push.merged:
            only = bool(push.merged)
            return cls(policy.version, merged={only: policy.merged_weights(only_adapted=only)})
        return cls(policy.version, policy.adapter_tensors(), policy.adapter_config())

    def adapter_tensors(self) -> dict:
        return self.tensors

    def adapter_config(self) -> dict:
        return self.config

    def merged_weights(self, only_adapted: bool = False) -> dict:
        return self.merged[only_adapted]


class FlipClock:
    """When each version was pushed and when each live engine first served it: the flip lag."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pushed: dict[int, float] = {}
        self._reached: dict[int, dict[int, float]] = {}
        # (version, lag) of the newest version all live engines serve
        self._last: tuple[int, float] | None = None

    def pushed(self, version: int, at: float) -> None:
        with self._lock:
            self._pushed[version] = at

    def reached(self, pool: EnginePool, member: Member, version: int, at: float) -> None:
        """`member` serves `version` (and every older one) from `at`."""
        with self._lock:
            for v in [v for v in self._pushed if v <= version]:
                self._reached.setdefault(v, {}).setdefault(member.index, at)
            live = [m.index for m in pool.alive()]
            for v in sorted(self._pushed):
                reached = self._reached.get(v, {})
                if all(i in reached for i in live):
                    self._last = (v, max(reached.values()) - self._pushed.pop(v))
                    self._reached.pop(v, None)

    def lag(self) -> tuple[int, float] | None:
        with self._lock:
            return self._last


class Updater:
    """One engine's update thread: applies the newest snapshot with that engine's push."""

    def __init__(
        self, fleet: FleetPush, member: Member, push: Push, timeline: Timeline | None
    ) -> None:
        self.fleet, self.member, self.push, self.timeline = fleet, member, push, timeline
        self.error: Exception | None = None  # the last push the engine refused
        self.refused_in_a_row = 0
        self._next: Snapshot | None = None
        self._busy = False
        self._stop = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(
            target=self._run, name=f"orbit-updater-{member.index}", daemon=True
        )
        self._thread.start()

    def offer(self, snapshot: Snapshot) -> None:
        with self._cond:
            self._next = snapshot  # latest wins: an older one not started yet is skipped
            self._cond.notify_all()

    def idle(self) -> bool:
        with self._cond:
            return self._next is None and not self._busy

    def wait_idle(self, seconds: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._busy, seconds)

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def _run(self) -> None:
        helper_thread()  # it copies tensors; the trainer's OpenMP team alone (orbit/host)
        while True:
            with self._cond:
                while self._next is None and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                snapshot, self._next, self._busy = self._next, None, True
            assert snapshot is not None  # the wait above ends on a snapshot or the stop
            engine = self.member.engine
            try:
                # One that came back may already hold it (brought up to the newest snapshot).
                if self.member.alive and snapshot.version > self.member.version:
                    t0 = time.time()
                    run_phases([Target(self.push, engine)], snapshot, self.timeline)
                    self.fleet.served(self.member, snapshot.version)
                    self.refused_in_a_row = 0
                    if self.timeline is not None:  # this engine's own update, load to flip
                        self.timeline.event(
                            "engine",
                            "update",
                            t0,
                            time.time(),
                            snapshot.version,
                            engine=self.member.index,
                        )
            except EngineDeadError as err:
                if engine is self.member.engine:  # not the one that has taken its place since
                    self.fleet.pool.drop(self.member, str(err))
            except Exception as err:  # noqa: BLE001 - the engine refused it and serves what it had
                self.error, self.refused_in_a_row = err, self.refused_in_a_row + 1
                self.fleet.refused(self.member, snapshot.version, err)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


class FleetPush:
    """The trainer's push over a pool: snapshot, then independent updaters or a barrier."""

    def __init__(
        self,
        mode_push: str,
        adapter_type: str,
        pool: EnginePool,
        flip: str = "independent",
        wait_all: bool = False,
        timeline: Timeline | None = None,
        wait_s: float = 600.0,
    ) -> None:
        if flip not in FLIPS:
            raise ValueError(f"flip must be one of {FLIPS}, got {flip!r}")
        self.pool, self.flip, self.wait_all, self.wait_s, self.timeline = (
            pool,
            flip,
            wait_all,
            wait_s,
            timeline,
        )
        self.pushes = [
            make_push(mode_push, adapter_type, pool.capabilities, m.index) for m in pool.members
        ]
        self.name = self.pushes[0].name
        self.clock = FlipClock()
        self.updaters = (
            [Updater(self, m, p, timeline) for m, p in zip(pool.members, self.pushes, strict=True)]
            if flip == "independent"
            else []
        )
        # the newest version pushed: what an engine that comes back gets
        self.latest: Snapshot | None = None
        self.refusals = 0  # pushes an engine refused (a metric)

    def refused(self, member: Member, version: int, err: Exception) -> None:
        """An engine refused `version` (its updater's report): warned, counted, on the timeline."""
        self.refusals += 1
        self.pool.on_warning(
            f"engine {member.index} refused the push of v{version} and serves v{member.version}: "
            f"{err}"
        )
        if self.timeline is not None:
            now = time.time()
            self.timeline.event(
                "engine", "refused", now, now, version, engine=member.index, reason=str(err)
            )

    def served(self, member: Member, version: int, at: float | None = None) -> None:
        """`member` finished its push of `version`: routing and the flip clock hear of it."""
        self.pool.serves(member, version)
        self.clock.reached(self.pool, member, version, time.time() if at is None else at)

    def initial(self, policy: PolicySource) -> None:
        """The starting policy on every engine, before any generation."""
        snapshot = self.latest = Snapshot.of(policy, self.pushes[0])
        self.pool.each(lambda m: self.pushes[m.index].initial(m.engine, snapshot))
        for m in self.pool.alive():
            self.served(m, policy.version)

    def bring_up(self, member: Member, engine: Engine) -> int:
        """The newest snapshot onto `engine`, which is to take `member`'s place; returns its
        version."""
        if self.updaters:
            self.updaters[member.index].wait_idle(self.wait_s)  # done with the engine that left
        snapshot = self._newest()
        self.pushes[member.index].initial(engine, snapshot, self.timeline)
        return snapshot.version

    def rejoined(self, member: Member) -> None:
        """`member` is back: a version pushed while it was brought up follows at once."""
        if self.updaters and self._newest().version > member.version:
            self.updaters[member.index].offer(self._newest())

    def _newest(self) -> Snapshot:
        assert self.latest is not None, "FleetPush.initial comes before any other push"
        return self.latest

    def push(self, policy: PolicySource) -> PushResult:
        t0 = time.time()
        self._raise_refusal()
        snapshot = self.latest = Snapshot.of(policy, self.pushes[0])
        self.clock.pushed(snapshot.version, t0)
        paused = 0.0
        if self.flip == "barrier":
            paused = self._barrier(snapshot)
        else:
            for updater in self.updaters:
                if updater.member.alive:
                    updater.offer(snapshot)
            if self.wait_all:
                self.wait_served(snapshot.version)
        return self.pushes[0].result(time.time() - t0, paused)

    def wait_served(self, version: int) -> None:
        """Block until every live engine serves `version` (serial modes stay on-policy)."""
        deadline = time.monotonic() + self.wait_s
        while late := [m for m in self.pool.alive() if m.version < version]:
            # on-policy needs every engine on the new version: a refusal stops the run
            for m in late:
                updater = self.updaters[m.index] if self.updaters else None
                if updater is not None and updater.idle() and (err := updater.error) is not None:
                    updater.error = None
                    raise err
            if time.monotonic() > deadline:
                names = ", ".join(f"engine {m.index} at v{m.version}" for m in late)
                raise EngineDeadError(
                    f"engines did not take version {version} within {self.wait_s:g} s: {names}"
                )
            time.sleep(0.005)
        self.pool.require_alive()

    def flip_lag(self) -> tuple[int, float] | None:
        return self.clock.lag()

    def finish(self, timeout: float = 60.0) -> None:
        """Let the updaters apply what they hold (the run is ending), then stop them."""
        deadline = time.monotonic() + timeout
        while (
            not all(u.idle() or not u.member.alive for u in self.updaters)
            and time.monotonic() < deadline
        ):
            time.sleep(0.01)
        self.stop()

    def stop(self) -> None:
        for updater in self.updaters:
            updater.stop()

    def _raise_refusal(self) -> None:
        """An engine that refused REFUSALS_IN_A_ROW pushes running stops the run, with the last
        refusal."""
        for updater in self.updaters:
            if updater.refused_in_a_row >= REFUSALS_IN_A_ROW and updater.member.alive:
                raise EngineError(
                    f"engine {updater.member.index} refused {updater.refused_in_a_row} pushes in a "
                    f"row; the last: {updater.error}"
                )

    def _barrier(self, snapshot: Snapshot) -> float:
        """The phases on every engine at once. Returns the paused seconds."""
        t_start = time.time()
        targets = {m.index: Target(self.pushes[m.index], m.engine) for m in self.pool.alive()}
        paused = run_phases(
            list(targets.values()),
            snapshot,
            self.timeline,
            each=lambda call: self.pool.each(lambda m: call(targets[m.index])),
        )
        now = time.time()
        for m in self.pool.alive():
            self.served(m, snapshot.version, now)
            if self.timeline is not None:
                self.timeline.event(
                    "engine", "update", t_start, now, snapshot.version, engine=m.index
                )
        return paused
