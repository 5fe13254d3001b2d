"""The five loop modes are two choices (docs/design.md §1): a loop kind and a push strategy.

The loop and the push are separate pieces (orbit/run/loop.py, orbit/push/); a mode only selects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Loop = Literal["serial", "overlapped"]
Push = Literal["full", "adapter", "double-buffer"]


@dataclass(frozen=True)
class Mode:
    name: str
    loop: Loop
    push: Push
    what_crosses: str

    @property
    def serial(self) -> bool:
        return self.loop == "serial"

    def max_staleness(self, recipe_bound: int | None) -> int | None:
        """The staleness a sample of this mode may have (docs/design.md §5): a serial loop trains
        each batch at the version that generated it (0); an overlapped one within the recipe's
        `max_staleness` (None: unbounded)."""
        return 0 if self.serial else recipe_bound


MODES: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("sync", "serial", "full", "all model weights (adapter merged in)"),
        Mode("sync-adapter", "serial", "adapter", "adapter tensors, into the one slot"),
        Mode("async-full", "overlapped", "full", "all model weights"),
        Mode("async-adapter", "overlapped", "adapter", "adapter tensors, into the one slot"),
        Mode(
            "double-buffer", "overlapped", "double-buffer", "adapter tensors into the inactive slot"
        ),
    )
}
MODE_NAMES = tuple(MODES)
