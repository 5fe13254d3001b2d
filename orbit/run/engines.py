"""Where a run's engines come from: the `Engines` a run is given (started for it, shared with the
other runs of a sweep, or a bench's own), and the engines' cores the trainer may borrow."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from orbit.config import EngineConfig, Recipe
from orbit.engine import EngineStarter, start_pool
from orbit.engine.pool import EnginePool
from orbit.metrics.steps import Timeline
from orbit.push.fleet import FleetPush
from orbit.rl.truncation import truncates
from orbit.run.revive import Revival
from orbit.train.cores import Cores


class Engines(Protocol):
    """Where a run's engines come from: started for it (`StartedEngines`), or shared with the other
    runs of a sweep (orbit/sweep/lanes.py)."""

    def pool(self, timeline: Timeline, warn: Callable[[str], None]) -> EnginePool: ...

    def revival(self, pool: EnginePool, push: FleetPush) -> Revival | None: ...


# a run's engines, from its recipe and placed engine section
EnginesFor = Callable[[Recipe, EngineConfig], Engines]


class StartedEngines:
    """A run's own engines: `engine.replicas` of them, started now, brought back when they die
    (revive.py)."""

    def __init__(self, recipe: Recipe, engine_cfg: EngineConfig) -> None:
        self.recipe = recipe
        self.starter = EngineStarter(
            engine_cfg,
            recipe.model,
            recipe.seed,
            recipe.adapter,
            call_timeout_s=recipe.rollout.stall_timeout_s,
            truncated=truncates(recipe.rollout.top_p, recipe.rollout.top_k)
            and recipe.rollout.temperature > 0,
        )

    def pool(self, timeline: Timeline, warn: Callable[[str], None]) -> EnginePool:
        return start_pool(self.starter, timeline=timeline, on_warning=warn)

    def revival(self, pool: EnginePool, push: FleetPush) -> Revival | None:
        if not self.recipe.engine.restarts:
            return None
        return Revival(
            pool,
            push,
            self.starter.start,
            attached=self.starter.attached,
            tries=self.recipe.engine.restarts,
            wait_s=self.recipe.rollout.stall_timeout_s,
        )


def _local(recipe: Recipe) -> bool:
    """The trainer (one rank) and every engine on this machine's CPU, the servers Orbit's own."""
    e = recipe.engine
    engines_here = e.servers is None and all(d == "cpu" for d in e.engine_devices())
    return engines_here and recipe.trainer.rank_devices() == ["cpu"]


def trainer_lends(recipe: Recipe, pool: EnginePool) -> Callable[[bool], None] | None:
    """What the pipeline tells as the trainer starts and stops waiting for a batch: the engines
    compute on its threads meanwhile (`engine.borrow_cores`; the embedded engine's, SGLang ignores
    it). When the engines are the bottleneck (DAPO's dynamic sampling, late in a run) the trainer
    waits for most of a step."""
    e = recipe.engine
    if not e.borrow_cores or e.backend in ("sglang", "sglang-server") or not _local(recipe):
        return None
    threads = recipe.trainer.threads
    return lambda waits: pool.lend_threads(threads if waits else 0)


def lendable_cores(recipe: Recipe) -> Cores | None:
    """The engines' threads the trainer may borrow while they are idle: with the trainer and every
    engine on this machine's CPU (one trainer rank; servers Orbit started, not attached ones),
    `trainer.borrow_cores` on (the default: it took 9% off the trainer's time per token beside the
    embedded engine and 6% beside SGLang, bench/investigations/trainer.md "The trainer borrowing
    idle cores")."""
    t, e = recipe.trainer, recipe.engine
    if not t.borrow_cores or not _local(recipe):
        return None
    return Cores(own=t.threads, lend=e.threads * e.engines)
