"""Completed groups waiting for the trainer, and the staleness policy (DESIGN §5)."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from orbit.rollout.groups import Group


@dataclass
class Batch:
    groups: list[Group]
    wait_s: float  # time the trainer was blocked waiting for it
    stale_dropped: int  # groups dropped as too stale while assembling it

    @property
    def samples(self):
        return [s for g in self.groups for s in g.samples]


class GroupBuffer:
    """A thread-safe queue of groups. The trainer takes whole batches; stale groups are dropped.

    `on_drop(n)` is called for every drop so the producer can replenish: without that, the
    pipeline would drain and `take` would wait forever. `on_take()` is called after every take:
    a producer that stopped because a full batch was waiting must learn that there is room again.
    """

    def __init__(self, max_staleness: int | None, on_drop=None, on_take=None) -> None:
        self.max_staleness = max_staleness
        self.on_drop = on_drop or (lambda n: None)
        self.on_take = on_take or (lambda: None)
        self._groups: deque[Group] = deque()
        self._cond = threading.Condition()
        self._error: BaseException | None = None

    def put(self, group: Group) -> None:
        with self._cond:
            self._groups.append(group)
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """The producer died: wake the trainer with its error instead of letting it wait."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._groups)

    def take(self, n: int, version: int, timeout: float | None = None) -> Batch:
        """Block until `n` fresh-enough groups are available for training at `version`."""
        t0 = time.time()
        taken: list[Group] = []
        dropped = 0
        with self._cond:
            while len(taken) < n:
                if self._error is not None:
                    raise RuntimeError(f"rollout producer failed: {self._error}") from self._error
                if not self._groups:
                    left = None if timeout is None else timeout - (time.time() - t0)
                    if left is not None and left <= 0:
                        raise TimeoutError(f"no batch after {timeout:.0f}s ({len(taken)}/{n} groups)")
                    self._cond.wait(timeout=left if left is not None else 1.0)
                    continue
                group = self._groups.popleft()
                if self.max_staleness is not None and group.staleness(version) > self.max_staleness:
                    dropped += 1
                    self.on_drop(1)
                    continue
                taken.append(group)
        self.on_take()
        return Batch(groups=taken, wait_s=time.time() - t0, stale_dropped=dropped)
