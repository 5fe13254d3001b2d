"""Push strategies: how a new policy version reaches the engine (DESIGN §1).

- full: merge the adapter into the base weights and ship all of them (`update_weights`).
- adapter: one slot; pause → flush → overwrite the slot → continue.
- double-buffer: write the *inactive* slot while the active one keeps serving, then
  pause → flush → activate → continue; the flip itself moves no tensors.

Pause modes: full and adapter pushes change weights that running requests use, so they pause in
`retract` mode (running requests recompute their KV with the new weights; SGLang also refuses
`flush_cache` with requests paused in place). Double-buffer changes nothing a running request
uses — it only moves the active pointer — so `in_place` suffices and nothing is recomputed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from orbit.engine.base import Engine, PauseMode
from orbit.metrics import Timeline


@dataclass
class PushResult:
    seconds: float  # update_weights_s: the whole sync call
    paused_s: float  # time between pause_generation and continue_generation
    flipped: bool = False
    full: bool = False


class PolicySource(Protocol):
    """What a push needs from the trainer."""

    version: int

    def adapter_tensors(self) -> dict: ...

    def adapter_config(self) -> dict: ...

    def merged_weights(self) -> dict: ...


class Push(Protocol):
    name: str

    def initial(self, engine: Engine, policy: PolicySource) -> None:
        """Put the starting policy into the engine before any generation."""
        ...

    def push(self, engine: Engine, policy: PolicySource, timeline: Timeline | None) -> PushResult: ...


def _paused(engine: Engine, mode: PauseMode, change, timeline: Timeline | None, version: int) -> float:
    """pause → flush → change() → continue; returns the paused seconds."""
    t0 = time.time()
    engine.pause_generation(mode)
    try:
        engine.flush_cache()
        change()
    finally:
        engine.continue_generation()
    t1 = time.time()
    if timeline:
        timeline.event("engine", "paused", t0, t1, version, mode=mode)
    return t1 - t0


def _load(engine: Engine, slot: int, policy: PolicySource, timeline: Timeline | None, tensors=None, config=None):
    """Write the policy's adapter into `slot`, recorded on the timeline as a `load_adapter` span."""
    tensors = policy.adapter_tensors() if tensors is None else tensors
    config = policy.adapter_config() if config is None else config
    t0 = time.time()
    engine.load_adapter(slot, tensors, config, policy.version)
    if timeline:
        timeline.event("engine", "load_adapter", t0, time.time(), policy.version, slot=slot)


class FullPush:
    name = "full"

    def initial(self, engine: Engine, policy: PolicySource) -> None:
        engine.update_weights(policy.merged_weights(), policy.version)
        engine.activate(None)

    def push(self, engine: Engine, policy: PolicySource, timeline: Timeline | None) -> PushResult:
        t0 = time.time()
        tensors = policy.merged_weights()
        paused = _paused(engine, "retract", lambda: engine.update_weights(tensors, policy.version),
                         timeline, policy.version)
        return PushResult(time.time() - t0, paused, full=True)


class AdapterPush:
    name = "adapter"
    slot = 0

    def initial(self, engine: Engine, policy: PolicySource) -> None:
        engine.load_adapter(self.slot, policy.adapter_tensors(), policy.adapter_config(), policy.version)
        engine.activate(self.slot)

    def push(self, engine: Engine, policy: PolicySource, timeline: Timeline | None) -> PushResult:
        t0 = time.time()
        tensors, config = policy.adapter_tensors(), policy.adapter_config()
        paused = _paused(
            engine, "retract", lambda: _load(engine, self.slot, policy, timeline, tensors, config),
            timeline, policy.version,
        )
        return PushResult(time.time() - t0, paused)


class DoubleBufferPush:
    name = "double-buffer"

    def __init__(self) -> None:
        self.active = 0

    def initial(self, engine: Engine, policy: PolicySource) -> None:
        engine.load_adapter(self.active, policy.adapter_tensors(), policy.adapter_config(), policy.version)
        engine.activate(self.active)

    def push(self, engine: Engine, policy: PolicySource, timeline: Timeline | None) -> PushResult:
        t0 = time.time()
        inactive = 1 - self.active
        # The active slot keeps serving while the inactive one is written.
        _load(engine, inactive, policy, timeline)
        paused = _paused(engine, "in_place", lambda: engine.activate(inactive), timeline, policy.version)
        self.active = inactive
        return PushResult(time.time() - t0, paused, flipped=True)


PUSHES = {"full": FullPush, "adapter": AdapterPush, "double-buffer": DoubleBufferPush}


def make_push(name: str) -> Push:
    return PUSHES[name]()
