"""One run's view of engines the runs of a sweep share: its own ring of slots and its own active
slot.

Run k of a sweep owns engine slots k·S .. k·S + S − 1 (S = `engine.slots`). Its `LaneEngine` shows
it an engine of S slots, so its push (orbit/push/) and pool (orbit/engine/pool.py) are a single
run's, unchanged. Its requests name their engine slot: the run's active slot, resolved here when the
request is submitted. So a run's flip is its own pointer moving; it changes nothing another run's
requests see, and nothing needs pausing: the pause of a single run's flip is there to move the
engine's one active slot between requests, and here that slot is not used. Nothing needs flushing
either: both engines key their prefix caches by slot and adapter load.

Requests of every run go to the same engines, which batch them together (slots are applied per row).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch

from orbit.engine.base import (
    ACTIVE,
    Completion,
    Engine,
    EngineError,
    EngineStats,
    PauseMode,
    SamplingParams,
    Slot,
)
from orbit.engine.pool import EnginePool
from orbit.engine.serving import ActiveSlot
from orbit.metrics.steps import Timeline
from orbit.push.fleet import FleetPush
from orbit.run.revive import Revival


class LaneEngine:
    """Slots `first` .. `first + slots - 1` of `engine`, as an engine of `slots` slots."""

    def __init__(self, engine: Engine, first: int, slots: int) -> None:
        self.engine, self.first, self.slots = engine, first, slots
        self.info = engine.info
        self.capabilities = dataclasses.replace(
            engine.capabilities, slots=slots, flush_while_running=False
        )
        self.adapter_transport = engine.adapter_transport
        self.active = ActiveSlot()  # this run's pointer; the engine checks the slot it names
        self._tokens = 0  # generated for this run: its finished requests' output tokens
        self._lock = threading.Lock()

    def _engine_slot(self, slot: int) -> int:
        if not 0 <= slot < self.slots:
            raise EngineError(f"slot {slot} is not one of this run's {self.slots} slots")
        return self.first + slot

    def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        slot: Slot = ACTIVE,
        meta: dict | None = None,
    ) -> Future[Completion]:
        bound = self.active.bind(slot)  # at submission, as an engine binds ACTIVE
        on = None if bound is None else self._engine_slot(bound)
        future = self.engine.generate(prompt_ids, sampling, on, meta)
        future.add_done_callback(self._count)
        return future

    def _count(self, future: Future[Completion]) -> None:
        if not future.cancelled() and future.exception() is None:
            with self._lock:
                self._tokens += len(future.result().output_ids)

    def load_adapter(
        self, slot: int, tensors: dict[str, torch.Tensor], adapter_config: dict, version: int
    ) -> float:
        return self.engine.load_adapter(self._engine_slot(slot), tensors, adapter_config, version)

    def activate(self, slot: int | None) -> None:
        if slot is not None:
            self._engine_slot(slot)  # checks it
        self.active.set(slot)

    # The flip of one run pauses and flushes nothing (module docstring).
    def pause_generation(self, mode: PauseMode = "in_place") -> None:  # noqa: ARG002 - protocol
        pass

    def flush_cache(self) -> None:
        pass

    def continue_generation(self) -> None:
        pass

    def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        raise EngineError(
            "a sweep's runs share the engines' base weights: a run cannot replace them"
        )

    def release_memory(self) -> None:
        raise EngineError(
            "a sweep's engines serve every run at once: one run cannot release their memory"
        )

    def resume_memory(self) -> None:
        raise EngineError(
            "a sweep's engines serve every run at once: one run cannot release their memory"
        )

    def stats(self) -> EngineStats:
        """This run's slots, active slot and generated tokens; the engine's time (busy, paused) and
        queues are every run's."""
        s = self.engine.stats()
        lane = slice(self.first, self.first + self.slots)
        with self._lock:
            tokens = self._tokens
        return dataclasses.replace(
            s,
            active_slot=self.active.get(),
            slot_versions=tuple(s.slot_versions[lane]),
            slot_requests=tuple(s.slot_requests[lane]),
            tokens_generated=tokens,
        )

    def heartbeat(self) -> int | None:
        return self.engine.heartbeat()

    def lend_threads(self, n: int) -> None:  # noqa: ARG002 - the protocol's
        """Ignored: the engine serves the other runs too, whose trainers are not waiting."""

    def shutdown(self) -> None:
        # The sweep stops the engines once every run is done. A run that stops early leaves them
        # serving the others; its requests still in flight finish there (the protocol aborts per
        # engine, not per request).
        pass

    def kill(self) -> None:
        self.engine.kill()  # its pool found it dead or hung: it is, for every run


class SharedEngines:
    """A sweep run's `Engines` (orbit/run/lifecycle.py): lane views of the sweep's engines. An
    engine that dies stops every run (each saving); bringing engines back is a single run's
    (`engine.restarts`), not yet a sweep's."""

    def __init__(self, engines: list[Engine], capacities: list[int], lane: int, slots: int) -> None:
        self.engines, self.capacities, self.lane, self.slots = engines, capacities, lane, slots

    def pool(self, timeline: Timeline, warn: Callable[[str], None]) -> EnginePool:
        views: list[Engine] = [
            LaneEngine(e, self.lane * self.slots, self.slots) for e in self.engines
        ]
        return EnginePool(views, self.capacities, timeline=timeline, on_warning=warn)

    # protocol
    def revival(self, pool: EnginePool, push: FleetPush) -> Revival | None:  # noqa: ARG002
        return None
