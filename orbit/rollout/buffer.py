"""Completed groups waiting for the trainer, and the staleness policy (docs/design.md §5)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from orbit.rollout.groups import Group

_POLL_S = 0.5


class RolloutError(RuntimeError):
    """Rollouts cannot go on: the producer failed (its cause is chained), a sample was aborted too
    often, or nothing arrived for `rollout.stall_timeout_s`. The message says what was seen."""


@dataclass
class Batch:
    groups: list[Group]
    wait_s: float  # time the trainer was blocked waiting for it
    stale_dropped: int  # groups dropped as too stale while assembling it
    dropped_tokens: int = 0  # tokens generated for those dropped groups (waste)

    @property
    def samples(self):
        return [s for g in self.groups for s in g.samples]


class GroupBuffer:
    """A thread-safe pool of complete groups. The trainer takes whole batches, oldest first; groups
    too stale to train are dropped.

    Deadlines: a group that started at version v must be trained by step v + K. When a group still
    in flight is at that deadline (`due_in_flight(v)` counts them), the trainer waits for it rather
    than taking newer complete groups past it: overtaken, it would be dropped next step, and the
    ones overtaken are the slow, long ones (a bias toward short rollouts).

    `on_drop(n)` is called for every drop so the producer can replenish: without that, the
    pipeline would drain and `take` would wait forever. `on_take()` is called after every take.
    `describe()` says what the rollout side is doing (in flight per engine, grants left), for the
    error when nothing arrives for `stall_s` seconds.
    """

    def __init__(self, max_staleness: int | None, on_drop=None, on_take=None,
                 describe: Callable[[], str] | None = None,
                 due_in_flight: Callable[[int], int] | None = None) -> None:
        self.max_staleness = max_staleness
        self.on_drop = on_drop or (lambda n: None)
        self.on_take = on_take or (lambda: None)
        self.describe = describe or (lambda: "")
        self.due_in_flight = due_in_flight or (lambda version: 0)
        self._groups: list[Group] = []
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._last_progress = time.monotonic()
        self.taken = 0  # groups handed to the trainer so far

    def put(self, group: Group) -> None:
        with self._cond:
            self._groups.append(group)
            self._last_progress = time.monotonic()
            self._cond.notify_all()

    def progress(self) -> None:
        """Something happened on the rollout side (a request finished): the pipeline is alive."""
        with self._cond:
            self._last_progress = time.monotonic()

    def fail(self, error: BaseException) -> None:
        """The producer died: wake the trainer with its error instead of letting it wait."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._groups)

    def take(self, n: int, version: int, stall_s: float | None = None) -> Batch:
        """Block until `n` fresh-enough groups are available for training at `version`; take the
        ones that started earliest (a slow group is trained, not overtaken until it is dropped).

        Raises RolloutError when the producer failed, or when nothing at all happened on the
        rollout side for `stall_s` seconds (the message says what was in flight)."""
        t0 = time.time()
        dropped: list[Group] = []
        with self._cond:
            while True:
                if self._error is not None:
                    raise RolloutError(f"rollout producer failed: {self._error}") from self._error
                stale = self._drop_stale(version)
                if stale:
                    dropped += stale
                    self.on_drop(len(stale))  # at once: the replacements must start while we wait
                if len(self._groups) >= n and not self._due_in_flight(version):
                    break
                quiet = time.monotonic() - self._last_progress
                if stall_s is not None and quiet > stall_s:
                    raise RolloutError(
                        f"no rollout arrived for {quiet:.0f} s (rollout.stall_timeout_s: {stall_s:g}) while the "
                        f"trainer waited for {n} groups at version {version}; {len(self._groups)} complete "
                        f"group(s) buffered; {self.describe()}")
                self._cond.wait(timeout=_POLL_S)
            self._groups.sort(key=lambda g: (g.oldest_version, g.id))
            taken, self._groups = self._groups[:n], self._groups[n:]
            self.taken += n
        self.on_take()
        return Batch(groups=taken, wait_s=time.time() - t0, stale_dropped=len(dropped),
                     dropped_tokens=sum(g.tokens for g in dropped))

    def _due_in_flight(self, version: int) -> bool:
        """Is a group still in flight that must be trained at this step (started at version - K)?"""
        return self.max_staleness is not None and self.due_in_flight(version - self.max_staleness) > 0

    def _drop_stale(self, version: int) -> list[Group]:
        if self.max_staleness is None:
            return []
        stale = [g for g in self._groups if g.staleness(version) > self.max_staleness]
        if stale:
            self._groups = [g for g in self._groups if g.staleness(version) <= self.max_staleness]
        return stale
