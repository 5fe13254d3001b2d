"""A straggler on purpose, for the pool bench (bench/pool.py) and its tests: the pool's last engine
started with a smaller batch and every adapter load made slower, so that what a straggler costs each
kind of flip shows. It reaches a run the way any engines do, as the run's `Engines`
(orbit/run/lifecycle.py): nothing in Orbit knows of it.

    engines = slowed(Slowing(running=8, load_s=0.3))
    train(checked, engines=engines)
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from orbit.config import EngineConfig, Recipe
from orbit.engine import EngineStarter, start_engine
from orbit.engine.base import Completion, Engine, EngineStats, PauseMode, SamplingParams, Slot
from orbit.run.engines import EnginesFor, StartedEngines


@dataclass(frozen=True)
class Slowing:
    running: int | None = None  # the last engine's max_running (None: the recipe's)
    load_s: float = 0.0  # added to each of its adapter loads, as a slow link to a far server would


class SlowLoads:
    """An engine whose every adapter load takes `load_s` longer; everything else is the engine's
    own."""

    def __init__(self, engine: Engine, load_s: float) -> None:
        self.engine, self.load_s = engine, load_s
        self.info, self.capabilities = engine.info, engine.capabilities
        self.adapter_transport = engine.adapter_transport

    def load_adapter(
        self, slot: int, tensors: dict[str, torch.Tensor], adapter_config: dict, version: int
    ) -> float:
        time.sleep(self.load_s)
        return self.engine.load_adapter(slot, tensors, adapter_config, version)

    def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        slot: Slot = "active",
        meta: dict | None = None,
    ) -> Future[Completion]:
        return self.engine.generate(prompt_ids, sampling, slot, meta)

    def activate(self, slot: int | None) -> None:
        self.engine.activate(slot)

    def pause_generation(self, mode: PauseMode = "in_place") -> None:
        self.engine.pause_generation(mode)

    def flush_cache(self) -> None:
        self.engine.flush_cache()

    def continue_generation(self) -> None:
        self.engine.continue_generation()

    def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        self.engine.update_weights(tensors, version)

    def release_memory(self) -> None:
        self.engine.release_memory()

    def resume_memory(self) -> None:
        self.engine.resume_memory()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def heartbeat(self) -> int | None:
        return self.engine.heartbeat()

    def lend_threads(self, n: int) -> None:
        self.engine.lend_threads(n)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def kill(self) -> None:
        self.engine.kill()


class SlowStarter(EngineStarter):
    """The run's starter, but its last engine slowed as `slowing` says (a subclass: revival restarts
    it slowed too)."""

    def __init__(self, starter: EngineStarter, slowing: Slowing) -> None:
        self.__dict__.update(starter.__dict__)
        self.slowing = slowing

    def _last(self, i: int) -> bool:
        return i == self.count - 1

    def start(self, i: int) -> Engine:
        cfg = self.cfg
        if self._last(i) and self.slowing.running:
            cfg = cfg.model_copy(update={"max_running": self.slowing.running})
        engine = start_engine(
            cfg,
            self.model,
            self.seed + i,
            self.adapter,
            self.call_timeout_s,
            self.devices[i],
            self.servers[i],
            self.truncated,
        )
        return (
            SlowLoads(engine, self.slowing.load_s)
            if self._last(i) and self.slowing.load_s
            else engine
        )

    def capacities(self) -> list[int]:
        running = self.slowing.running or self.cfg.max_running
        return [*super().capacities()[:-1], running]


def slowed(slowing: Slowing) -> EnginesFor:
    """A run's own engines (as `StartedEngines`), the last one slowed."""

    def engines(recipe: Recipe, engine_cfg: EngineConfig) -> StartedEngines:
        started = StartedEngines(recipe, engine_cfg)
        started.starter = SlowStarter(started.starter, slowing)
        return started

    return engines
