"""The active slot: which slot a request submitted as ACTIVE binds to.

Each engine holds one (the embedded engine, SGLang) and so does each run's lane of a sweep, whose
flip is this pointer alone (sweep/lanes.py). Nothing else keeps a copy: the push, the pool and the
metrics ask the engine (`stats().active_slot`), and the version an engine serves is the one its push
reported last (`EnginePool.serves`, one writer)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from orbit.engine.base import ACTIVE, EngineError, Slot


class ActiveSlot:
    """The pointer, guarded: `holds(slot)` says whether a slot has an adapter (None: the engine
    checks)."""

    def __init__(self, holds: Callable[[int], bool] | None = None) -> None:
        self._slot: int | None = None
        self._holds = holds
        self._lock = threading.Lock()

    def get(self) -> int | None:
        with self._lock:
            return self._slot

    def set(self, slot: int | None) -> None:
        """New ACTIVE requests bind to `slot` (None: the base weights). Refused for an empty
        slot."""
        if slot is not None and self._holds is not None and not self._holds(slot):
            raise EngineError(f"cannot activate slot {slot}: it is empty")
        with self._lock:
            self._slot = slot

    def bind(self, slot: Slot) -> int | None:
        """The slot a request submitted now runs on: ACTIVE resolved at submission, never re-bound
        later."""
        bound = self.get() if slot == ACTIVE else slot
        if bound is not None and self._holds is not None and not self._holds(bound):
            raise EngineError(f"slot {bound} is empty: load_adapter into it first")
        return bound
