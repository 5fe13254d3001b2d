"""Push strategies: how a new policy version reaches one engine (docs/design.md §1), in phases.

- full: merge the adapter into the base weights and ship all of them (`update_weights`).
- adapter: one slot; pause → flush → overwrite the slot → continue.
- double-buffer: write an inactive slot while the active one keeps serving, then
  pause → activate → continue; the flip itself moves no tensors. With `engine.slots: S` the slots
  form a ring and a load goes to the slot inactive longest with no request of its own left.
- merged: OFT on an engine without OFT slots (SGLang serves LoRA only): the merged weights of
  the OFT-adapted modules only (`merged_weights(only_adapted=True)`), as a full push does. Chosen
  for the adapter and double-buffer modes there; marked `merged_push` in the metrics.

Every strategy is three phases: `prepare` runs while the engine serves, `apply` while it is paused
in `pause_mode` (right after `prepare` when `pause_mode` is None). `run_phases` runs them over one
engine or, for the barrier (fleet.py), over every engine of a pool phase by phase: one code path.

`make_push` picks the strategy from (the mode's push, the adapter type, the engine's capabilities):
- `oft_slots`: OFT adapters load into slots (embedded yes, SGLang no → merged push);
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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from orbit.engine.base import Capabilities, Engine, PauseMode
from orbit.metrics.steps import Timeline

PUSHES = ("full", "adapter", "double-buffer")


@dataclass
class PushResult:
    seconds: float  # update_weights_s: how long the push held the trainer
    paused_s: float  # time between pause_generation and continue_generation
    flipped: bool = False
    full: bool = False
    # merged weights of the adapted modules only (OFT on an engine without OFT slots)
    merged: bool = False


class PolicySource(Protocol):
    """What a push reads of a policy version (a `Snapshot` of the trainer, fleet.py)."""

    version: int

    def adapter_tensors(self) -> dict: ...

    def adapter_config(self) -> dict: ...

    def merged_weights(self, only_adapted: bool = False) -> dict: ...


def _event(
    timeline: Timeline | None, kind: str, t0: float, version: int, engine: int, **extra
) -> None:
    if timeline is not None:
        timeline.event("engine", kind, t0, time.time(), version, engine=engine, **extra)


class Push:
    """One engine's push, in phases (see the module docstring). Subclasses set the class attributes
    and override `initial`, `prepare` and `apply`."""

    name = "push"
    pause_mode: PauseMode | None = "retract"
    flips = False
    full = False
    merged = False

    def __init__(self, engine_index: int = 0) -> None:
        self.engine_index = engine_index  # tags this engine's timeline events

    def initial(
        self, engine: Engine, policy: PolicySource, timeline: Timeline | None = None
    ) -> None:
        """Put the policy into an engine before it generates anything (at the start, or an engine
        that came back: its load is then on the timeline)."""
        raise NotImplementedError

    def prepare(self, engine: Engine, policy: PolicySource, timeline: Timeline | None) -> None:
        """What can be done while the engine serves."""

    def apply(self, engine: Engine, policy: PolicySource, timeline: Timeline | None) -> None:
        """What must be done while it is paused in `pause_mode`."""

    def result(self, seconds: float, paused_s: float) -> PushResult:
        return PushResult(seconds, paused_s, flipped=self.flips, full=self.full, merged=self.merged)

    def _load(
        self, engine: Engine, slot: int, policy: PolicySource, timeline: Timeline | None
    ) -> None:
        """Write the policy's adapter into `slot`, recorded as a `load_adapter` span: the span is
        the trainer side's view (transfer included); `written` is the engine's own time of the
        write, the moment no request on that slot may be running."""
        t0 = time.time()
        written = engine.load_adapter(
            slot, policy.adapter_tensors(), policy.adapter_config(), policy.version
        )
        _event(
            timeline,
            "load_adapter",
            t0,
            policy.version,
            self.engine_index,
            slot=slot,
            written=written,
        )


@dataclass
class Target:
    """One engine and its push."""

    push: Push
    engine: Engine


def run_phases(
    targets: list[Target],
    policy: PolicySource,
    timeline: Timeline | None,
    each: Callable[[Callable[[Target], object]], object] | None = None,
) -> float:
    """prepare on every target; pause all; apply all; continue all. `each(call)` runs a phase over
    the targets (default: one after the other; the barrier runs it on every engine at once).
    Returns the seconds generation was paused."""
    each = each or (lambda call: [call(t) for t in targets])
    each(lambda t: t.push.prepare(t.engine, policy, timeline))
    mode = targets[0].push.pause_mode
    if mode is None:
        each(lambda t: t.push.apply(t.engine, policy, timeline))
        return 0.0
    t_pause = time.time()
    each(lambda t: t.engine.pause_generation(mode))
    try:
        each(lambda t: t.push.apply(t.engine, policy, timeline))
    finally:
        each(lambda t: t.engine.continue_generation())
    for t in targets:
        _event(timeline, "paused", t_pause, policy.version, t.push.engine_index, mode=mode)
    return time.time() - t_pause


class FullPush(Push):
    name = "full"
    full = True
    only_adapted = False  # all of the model's weights

    def initial(
        self, engine: Engine, policy: PolicySource, timeline: Timeline | None = None
    ) -> None:
        engine.update_weights(policy.merged_weights(only_adapted=self.only_adapted), policy.version)
        engine.activate(None)

    def apply(self, engine: Engine, policy: PolicySource, timeline: Timeline | None) -> None:
        engine.flush_cache()
        engine.update_weights(policy.merged_weights(only_adapted=self.only_adapted), policy.version)


class MergedPush(FullPush):
    """OFT where the engine has no OFT slots: the adapted modules' merged weights, as a full push.

    Each push overwrites those modules with W·Rᵀ computed from the trainer's frozen base, so
    nothing accumulates on the engine side. Costs the adapted modules' full weights per push
    (README: "OFT on SGLang") instead of the adapter's few tensors, and a retract pause.
    """

    name = "merged"
    full = False
    merged = True
    only_adapted = True


class AdapterPush(Push):
    name = "adapter"
    slot = 0

    def __init__(self, engine_index: int = 0, load_while_paused: bool = True) -> None:
        super().__init__(engine_index)
        self.load_while_paused = load_while_paused
        # Where the engine cannot load under paused requests, it swaps the slot while generation
        # runs: requests on it finish on the old adapter, new ones wait for the new one (no pause,
        # no recompute).
        self.pause_mode = "retract" if load_while_paused else None

    def initial(
        self, engine: Engine, policy: PolicySource, timeline: Timeline | None = None
    ) -> None:
        self._load(engine, self.slot, policy, timeline)
        engine.activate(self.slot)

    def apply(self, engine: Engine, policy: PolicySource, timeline: Timeline | None) -> None:
        if self.load_while_paused:
            engine.flush_cache()
        self._load(engine, self.slot, policy, timeline)


class DoubleBufferPush(Push):
    name = "double-buffer"
    pause_mode = "in_place"
    flips = True

    def __init__(self, engine_index: int = 0, slots: int = 2, flush: bool = True) -> None:
        super().__init__(engine_index)
        self.slots = slots
        # False where flush_cache refuses running requests (its cache is per adapter load)
        self.flush = flush
        self.target = 1
        # The ring's own memory: the flip at which each slot was last activated (-1: never). Which
        # slot is active now is the engine's to say (`stats().active_slot`); the push keeps no copy
        # of it.
        self._activated = [-1] * slots
        self._flips = 0

    def initial(
        self, engine: Engine, policy: PolicySource, timeline: Timeline | None = None
    ) -> None:
        self._load(engine, 0, policy, timeline)
        engine.activate(0)
        self._activated[0] = self._flips

    def choose_slot(self, active: int | None, slot_requests: tuple[int, ...]) -> int:
        """The ring: the slot inactive longest among those with no request of their own left, else
        the one inactive longest (its requests are then aborted, or waited for, by the engine). A
        slot stops being active when the next one is activated, so the earliest activated is
        inactive longest."""
        others = [s for s in range(self.slots) if s != active]
        return min(
            others,
            key=lambda s: (
                slot_requests[s] > 0 if s < len(slot_requests) else False,
                self._activated[s],
            ),
        )

    def prepare(self, engine: Engine, policy: PolicySource, timeline: Timeline | None) -> None:
        # The active slot keeps serving while another one is written.
        stats = engine.stats()
        self.target = self.choose_slot(stats.active_slot, stats.slot_requests)
        self._load(engine, self.target, policy, timeline)

    def apply(self, engine: Engine, policy: PolicySource, timeline: Timeline | None) -> None:
        if self.flush:
            engine.flush_cache()
        engine.activate(self.target)
        self._flips += 1
        self._activated[self.target] = self._flips


def make_push(
    name: str, adapter_type: str, capabilities: Capabilities, engine_index: int = 0
) -> Push:
    """One engine's push for a mode's `push` on this adapter type and engine (module docstring)."""
    if name == "full":
        return FullPush(engine_index)
    if adapter_type == "oft" and not capabilities.oft_slots:
        return MergedPush(engine_index)
    if name == "adapter":
        return AdapterPush(engine_index, load_while_paused=capabilities.loads_while_paused)
    if name == "double-buffer":
        return DoubleBufferPush(
            engine_index, slots=capabilities.slots, flush=capabilities.flush_while_running
        )
    raise ValueError(f"unknown push {name!r} (allowed: {', '.join(PUSHES)})")
