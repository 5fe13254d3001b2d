"""Pushing a new policy version to every engine of a pool (docs/design.md §8).

A push freezes the policy into a `Snapshot` (one copy, in the trainer's thread), then either
- `independent` (the default): hands it to one `Updater` thread per engine and returns. Each updater
  runs its engine's own push (sync.py: e.g. load the ring slot, pause in place, activate, continue)
  as soon as it can; an engine still busy with version v when v+2 arrives skips to v+2 (latest
  wins). No engine waits for another, and the trainer waits for none of them;
- `barrier` (for comparison, the peers' way): every engine's `prepare`, then every pause, every
  `apply`, every continue, each phase across all engines at once, while the trainer waits.
Serial modes stay on-policy: the trainer waits until every live engine serves the new version
before the next batch is granted, whichever the flip.

`update_weights_s` is the time the trainer was held: the snapshot alone for independent flips.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from orbit.engine.base import EngineDeadError
from orbit.engine.pool import EnginePool, Member
from orbit.metrics import Timeline
from orbit.sync import PolicySource, Push, PushResult, make_push

FLIPS = ("independent", "barrier")


@dataclass
class Snapshot:
    """One policy version, frozen: what the pushes read, while the trainer moves on."""

    version: int
    tensors: dict | None = None
    config: dict | None = None
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


class Updater:
    """One engine's update thread: applies the newest snapshot with that engine's push."""

    def __init__(self, pool: EnginePool, member: Member, push: Push, timeline: Timeline | None) -> None:
        self.pool, self.member, self.push, self.timeline = pool, member, push, timeline
        self.error: Exception | None = None  # a push the engine refused: reported at the next push
        self._next: Snapshot | None = None
        self._busy = False
        self._stop = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"orbit-updater-{member.index}", daemon=True)
        self._thread.start()

    def offer(self, snapshot: Snapshot) -> None:
        with self._cond:
            self._next = snapshot  # latest wins: an older one not started yet is skipped
            self._cond.notify_all()

    def idle(self) -> bool:
        with self._cond:
            return self._next is None and not self._busy

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._next is None and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                snapshot, self._next, self._busy = self._next, None, True
            try:
                if self.member.alive:
                    t0 = time.time()
                    self.push.push(self.member.engine, snapshot, self.timeline)
                    self.pool.serves(self.member, snapshot.version)
                    if self.timeline is not None:  # this engine's own update, load to flip
                        self.timeline.event("engine", "update", t0, time.time(), snapshot.version,
                                            engine=self.member.index)
            except EngineDeadError as err:
                self.pool._lose(self.member, str(err))
            except Exception as err:  # noqa: BLE001 - the engine refused it: the trainer hears of it next push
                self.error = err
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


class PoolPush:
    """The trainer's push over a pool: snapshot, then independent updaters or a barrier."""

    def __init__(self, mode_push: str, adapter_type: str, pool: EnginePool, flip: str = "independent",
                 wait_all: bool = False, timeline: Timeline | None = None, wait_s: float = 600.0) -> None:
        if flip not in FLIPS:
            raise ValueError(f"flip must be one of {FLIPS}, got {flip!r}")
        self.pool, self.flip, self.wait_all, self.wait_s = pool, flip, wait_all, wait_s
        self.pushes = [make_push(mode_push, adapter_type, m.engine, m.index) for m in pool.members]
        self.name = self.pushes[0].name
        self.updaters = [Updater(pool, m, p, timeline) for m, p in zip(pool.members, self.pushes, strict=True)] \
            if flip == "independent" else []

    def initial(self, pool: EnginePool, policy: PolicySource) -> None:
        """The starting policy on every engine, before any generation."""
        snapshot = Snapshot.of(policy, self.pushes[0])
        pool.each(lambda m: self.pushes[m.index].initial(m.engine, snapshot))
        for m in pool.alive():
            pool.serves(m, policy.version)

    def push(self, pool: EnginePool, policy: PolicySource, timeline: Timeline | None) -> PushResult:
        t0 = time.time()
        self._raise_refusal()
        snapshot = Snapshot.of(policy, self.pushes[0])
        pool.pushed(snapshot.version, t0)
        paused = 0.0
        if self.flip == "barrier":
            paused = self._barrier(pool, snapshot, timeline)
        else:
            for updater in self.updaters:
                if updater.member.alive:
                    updater.offer(snapshot)
            if self.wait_all:
                pool.wait_version(snapshot.version, self.wait_s)
                self._raise_refusal()
        return self.pushes[0].result(time.time() - t0, paused)

    def finish(self, timeout: float = 60.0) -> None:
        """Let the updaters apply what they hold (the run is ending), then stop them."""
        deadline = time.monotonic() + timeout
        while not all(u.idle() or not u.member.alive for u in self.updaters) and time.monotonic() < deadline:
            time.sleep(0.01)
        for updater in self.updaters:
            updater.stop()
        self._raise_refusal()

    def _raise_refusal(self) -> None:
        for updater in self.updaters:
            if updater.error is not None:
                err, updater.error = updater.error, None
                raise err

    def _barrier(self, pool: EnginePool, snapshot: Snapshot, timeline: Timeline | None) -> float:
        """Every engine's prepare; pause all; apply all; continue all. Returns the paused seconds."""
        def on_all(call) -> None:
            pool.each(lambda m: call(self.pushes[m.index], m))

        t_start = time.time()
        on_all(lambda push, m: push.prepare(m.engine, snapshot, timeline))
        mode = self.pushes[0].pause_mode
        t_pause = time.time()
        if mode is None:
            on_all(lambda push, m: push.apply(m.engine, snapshot, timeline))
        else:
            on_all(lambda push, m: m.engine.pause_generation(mode))
            try:
                on_all(lambda push, m: push.apply(m.engine, snapshot, timeline))
            finally:
                on_all(lambda push, m: m.engine.continue_generation())
            if timeline is not None:
                for m in pool.alive():
                    timeline.event("engine", "paused", t_pause, time.time(), snapshot.version, engine=m.index,
                                   mode=mode)
        now = time.time()
        for m in pool.alive():
            pool.serves(m, snapshot.version, now)
            if timeline is not None:
                timeline.event("engine", "update", t_start, now, snapshot.version, engine=m.index)
        return now - t_pause if mode is not None else 0.0
