"""Push strategies: how a new policy version reaches the engine (docs/design.md §1).

- full: merge the adapter into the base weights and ship all of them (`update_weights`).
- adapter: one slot; pause → flush → overwrite the slot → continue.
- double-buffer: write the *inactive* slot while the active one keeps serving, then
  pause → flush → activate → continue; the flip itself moves no tensors.
- merged: OFT on an engine without OFT slots (SGLang serves LoRA only): the merged weights of
  the OFT-adapted modules only (`merged_weights(only_adapted=True)`), as a full push does. Chosen
  for the adapter and double-buffer modes there; marked `merged_push` in the metrics.

`make_push` picks the strategy from (the mode's push, the adapter type, the engine's
capabilities). Engines declare what they cannot do with class attributes (absent = can):
- `supports_oft_slots`: OFT adapters load into slots (embedded yes, SGLang no → merged push);
- `loads_while_paused`: a slot can be overwritten while paused requests are bound to it. SGLang
  cannot (replacing a slot unloads its adapter, which waits for every request using it, and
  paused requests never finish), so its adapter push loads *while generation runs*: the engine
  holds new requests for the slot, lets the running ones finish on the old adapter, swaps;
- `flush_while_running`: `flush_cache` works during an `in_place` pause with requests running.
  SGLang refuses it; its prefix cache is keyed by each adapter load, so the flip needs no flush.

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
    merged: bool = False  # merged weights of the adapted modules only (OFT on an engine without OFT slots)


class PolicySource(Protocol):
    """What a push needs from the trainer."""

    version: int

    def adapter_tensors(self) -> dict: ...

    def adapter_config(self) -> dict: ...

    def merged_weights(self, only_adapted: bool = False) -> dict: ...


class Push(Protocol):
    name: str

    def initial(self, engine: Engine, policy: PolicySource) -> None:
        """Put the starting policy into the engine before any generation."""
        ...

    def push(self, engine: Engine, policy: PolicySource, timeline: Timeline | None) -> PushResult: ...


def _paused(engine: Engine, mode: PauseMode, change, timeline: Timeline | None, version: int,
            flush: bool = True) -> float:
    """pause → flush → change() → continue; returns the paused seconds."""
    t0 = time.time()
    engine.pause_generation(mode)
    try:
        if flush:
            engine.flush_cache()
        change()
    finally:
        engine.continue_generation()
    t1 = time.time()
    if timeline:
        timeline.event("engine", "paused", t0, t1, version, mode=mode)
    return t1 - t0


def _load(engine: Engine, slot: int, policy: PolicySource, timeline: Timeline | None, tensors=None, config=None):
    """Write the policy's adapter into `slot`, recorded on the timeline as a `load_adapter` span.

    The span is the trainer's view of the call (transfer included); `written` is the engine's own
    time of the write, the moment no request on that slot may be running."""
    tensors = policy.adapter_tensors() if tensors is None else tensors
    config = policy.adapter_config() if config is None else config
    t0 = time.time()
    written = engine.load_adapter(slot, tensors, config, policy.version)
    if timeline:
        timeline.event("engine", "load_adapter", t0, time.time(), policy.version, slot=slot, written=written)


class FullPush:
    name = "full"
    only_adapted = False  # all of the model's weights

    def initial(self, engine: Engine, policy: PolicySource) -> None:
        engine.update_weights(policy.merged_weights(only_adapted=self.only_adapted), policy.version)
        engine.activate(None)

    def push(self, engine: Engine, policy: PolicySource, timeline: Timeline | None) -> PushResult:
        t0 = time.time()
        tensors = policy.merged_weights(only_adapted=self.only_adapted)
        paused = _paused(engine, "retract", lambda: engine.update_weights(tensors, policy.version),
                         timeline, policy.version)
        return PushResult(time.time() - t0, paused, full=not self.only_adapted, merged=self.only_adapted)


class MergedPush(FullPush):
    """OFT where the engine has no OFT slots: the adapted modules' merged weights, as a full push.

    Each push overwrites those modules with W·Rᵀ computed from the trainer's frozen base, so
    nothing accumulates on the engine side. Costs the adapted modules' full weights per push
    (README: "OFT on SGLang") instead of the adapter's few tensors, and a retract pause.
    """

    name = "merged"
    only_adapted = True


class AdapterPush:
    name = "adapter"
    slot = 0

    def __init__(self, load_while_paused: bool = True) -> None:
        self.load_while_paused = load_while_paused

    def initial(self, engine: Engine, policy: PolicySource) -> None:
        engine.load_adapter(self.slot, policy.adapter_tensors(), policy.adapter_config(), policy.version)
        engine.activate(self.slot)

    def push(self, engine: Engine, policy: PolicySource, timeline: Timeline | None) -> PushResult:
        t0 = time.time()
        tensors, config = policy.adapter_tensors(), policy.adapter_config()
        if not self.load_while_paused:
            # The engine swaps the slot while generation runs: requests on it finish on the old
            # adapter, new ones wait for the new one (nothing is paused, nothing recomputed).
            _load(engine, self.slot, policy, timeline, tensors, config)
            return PushResult(time.time() - t0, 0.0)
        paused = _paused(
            engine, "retract", lambda: _load(engine, self.slot, policy, timeline, tensors, config),
            timeline, policy.version,
        )
        return PushResult(time.time() - t0, paused)


class DoubleBufferPush:
    name = "double-buffer"

    def __init__(self, flush: bool = True) -> None:
        self.active = 0
        self.flush = flush  # False where flush_cache refuses running requests (its cache is per adapter load)

    def initial(self, engine: Engine, policy: PolicySource) -> None:
        engine.load_adapter(self.active, policy.adapter_tensors(), policy.adapter_config(), policy.version)
        engine.activate(self.active)

    def push(self, engine: Engine, policy: PolicySource, timeline: Timeline | None) -> PushResult:
        t0 = time.time()
        inactive = 1 - self.active
        # The active slot keeps serving while the inactive one is written.
        _load(engine, inactive, policy, timeline)
        paused = _paused(engine, "in_place", lambda: engine.activate(inactive), timeline, policy.version,
                         flush=self.flush)
        self.active = inactive
        return PushResult(time.time() - t0, paused, flipped=True)


def make_push(name: str, adapter_type: str = "lora", engine: Engine | None = None) -> Push:
    """The push for a mode's `push` on this adapter type and engine (see the module docstring)."""
    if name == "full":
        return FullPush()
    if adapter_type == "oft" and not getattr(engine, "supports_oft_slots", True):
        return MergedPush()
    if name == "adapter":
        return AdapterPush(load_while_paused=getattr(engine, "loads_while_paused", True))
    if name == "double-buffer":
        return DoubleBufferPush(flush=getattr(engine, "flush_while_running", True))
    raise ValueError(f"unknown push {name!r} (allowed: full, adapter, double-buffer)")
