"""`orbit train`: build the pieces a recipe names, run the loop, and always leave a usable run.

A run directory holds `recipe.yaml`, `metrics.jsonl`, `timeline.jsonl`, `samples.jsonl` and
`adapter/` (peft's format plus optimizer state). However a run ends, what it leaves agrees with
itself:
- a run that fails (or is interrupted) before its first step leaves nothing in the way: the
  files it created are removed, so the same command can simply run again;
- once it has stepped, Ctrl-C, an engine's death or a rollout failure stops the engine, saves the
  adapter of the last step with its metrics line, and says how to `--resume`;
- `--resume RUN_DIR` continues from the checkpoint: same step numbering, the prompt stream where it
  stopped, the same random state (a serial run resumed equals the run never stopped).
"""

from __future__ import annotations

import _thread
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from orbit.agents import AgentRunner, Endpoint
from orbit.config import Recipe, dump_recipe
from orbit.config.modes import MODES
from orbit.engine.pool import EnginePool
from orbit.host import interrupts
from orbit.host.interrupts import Interrupted
from orbit.metrics.steps import JsonlWriter, Timeline
from orbit.push.fleet import FleetPush
from orbit.rollout.groups import Screen, Signal
from orbit.rollout.pipeline import Pipeline, sampling_params
from orbit.rollout.producer import Producer
from orbit.run.directory import (
    drop_lines_after,
    left,
    prepare_run_dir,
    saved_line,
    undo_start,
    warner,
)
from orbit.run.ends import RunStopped, judge, sentence
from orbit.run.engines import (
    Engines,
    EnginesFor,
    StartedEngines,
    lendable_cores,
    trainer_lends,
)
from orbit.run.loop import LoopParts, logprob_warn, run_steps, save_checkpoint
from orbit.run.placement import colocate
from orbit.run.preflight import Checked, stop_token_ids
from orbit.run.revive import Revival
from orbit.run.trackers import Trackers, open_trackers
from orbit.tasks import close_task, is_agent, make_task
from orbit.train import checkpoint
from orbit.train.launcher import launched
from orbit.train.ranks import Ranks
from orbit.train.trainer import Trainer, recipe_trainer


@dataclass
class RunResult:
    run_dir: Path
    steps_done: int
    seconds: float
    leader: bool = True  # False on trainer ranks other than 0, which only followed rank 0's steps


@dataclass
class StartedRun:
    """What a started run holds, for stopping it cleanly."""

    trainer: Trainer
    metrics: JsonlWriter
    timeline: Timeline
    pool: EnginePool | None = None
    push: FleetPush | None = None
    revival: Revival | None = None
    producer: Producer | None = None
    endpoint: Endpoint | None = None  # an agent task's (orbit/agents)
    parts: LoopParts | None = None
    start_version: int = 0
    trackers: Trackers | None = None

    @property
    def loop(self) -> LoopParts:
        """The loop's parts: `start` sets them last, and nothing runs the loop before it returns."""
        assert self.parts is not None, "start() has not finished"
        return self.parts

    def close_files(self) -> None:
        """metrics.jsonl, timeline.jsonl and the trackers, flushed and closed (each is
        idempotent)."""
        self.metrics.close()
        self.timeline.close()
        if self.trackers is not None:
            self.trackers.close()


def train(
    checked: Checked,
    resume: bool = False,
    live: bool = True,
    console: Console | None = None,
    engines: EnginesFor | None = None,
) -> RunResult:
    """Run a recipe (that passed `orbit.run.preflight`) to its last step. `engines`: where the run's
    engines come from, given the recipe and its engine section as placed (default: `StartedEngines`,
    started for it)."""
    console = console or Console()
    recipe = checked.recipe
    t0 = time.time()
    ranks = _join_ranks(recipe)
    if ranks is not None and not ranks.leader:
        return _follow(recipe, ranks, t0)
    try:
        with interrupts.remembered():
            return _lead(checked, resume, live, console, engines or StartedEngines, ranks, t0)
    finally:
        if ranks is not None:
            ranks.close()


def _join_ranks(recipe: Recipe) -> Ranks | None:
    """This process's place among the trainer ranks, when a launcher started several (ranks.py)."""
    info, cfg = launched(), recipe.trainer
    if info is None or (info.world == 1 and len(cfg.rank_devices()) == 1):
        return None  # one process (torchrun with one rank included)
    return Ranks(info, cfg.rank_devices(), cfg.rank_timeout_s)


def _follow(recipe: Recipe, ranks: Ranks, t0: float) -> RunResult:
    """A trainer rank other than 0: train each step's share until rank 0 says stop. Ctrl-C is rank
    0's to handle (it needs this rank to finish the step it saves)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        trainer = recipe_trainer(recipe, ranks=ranks)
        trainer.follow()
    finally:
        ranks.close()
    return RunResult(Path(recipe.out), trainer.version, time.time() - t0, leader=False)


def _lead(
    checked: Checked,
    resume: bool,
    live: bool,
    console: Console,
    engines: EnginesFor,
    ranks: Ranks | None,
    t0: float,
) -> RunResult:
    """The run itself (rank 0 of several, or the one process)."""
    recipe = checked.recipe
    for note in checked.notes:
        console.print(note, highlight=False)
    run_dir = Path(recipe.out)
    if ranks is not None:
        # The launcher stops rank 0 with SIGTERM when another rank fails: save, as for Ctrl-C. So
        # does a rank lost to the heartbeat (ranks.py), which says which one.
        interrupts.catch_term()
        ranks.on_lost = lambda: _thread.interrupt_main(signal.SIGTERM)
    # The task first: a bad task (import path, dataset row, option) fails before any compute.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(recipe.model)
    task = make_task(recipe.task, tokenizer)
    try:
        stop_ids = stop_token_ids(tokenizer, recipe.rollout.stop)
        interrupts.raise_if_dropped()
        created = prepare_run_dir(run_dir, resume)
        try:
            shards = ranks.world if ranks is not None and recipe.trainer.shard == "fsdp" else 1
            # before the trainer takes its part of a shared GPU
            engine_cfg, shared = colocate(recipe, shards)
            if shared:
                console.print(shared, highlight=False)
            trainer = recipe_trainer(recipe, ranks=ranks)
            run = start(
                recipe,
                run_dir,
                resume,
                task,
                stop_ids,
                console,
                live,
                trainer,
                engines(recipe, engine_cfg),
                tokenizer,
            )
        except BaseException as err:
            undo_start(run_dir, created, resume)
            if isinstance(err, KeyboardInterrupt):
                interrupts.handled()
                raise Interrupted(
                    f"interrupted during start-up: nothing was trained{left(run_dir, resume)}"
                ) from None
            raise
        try:
            finish(run, recipe, run_dir, created, resume)
        finally:
            run.trainer.close()
            run.close_files()
    finally:
        close_task(task)  # after the producer stopped: nothing scores any more
    return RunResult(run_dir, run.trainer.version - run.start_version, time.time() - t0)


def start(
    recipe: Recipe,
    run_dir: Path,
    resume: bool,
    task,
    stop_ids: tuple[int, ...],
    console: Console,
    live: bool,
    trainer: Trainer,
    engines: Engines,
    tokenizer,
    name: str | None = None,
    group: str | None = None,
) -> StartedRun:
    """The starting adapter on the engines, the producer: everything but the loop. `name`: a sweep's
    run, which its console lines and timeline say; `group`: the sweep (its trackers' group)."""
    mode = MODES[recipe.mode]
    prefix = f"{name}: " if name else ""
    run_state = {}
    try:
        if resume:
            run_state = _resume(trainer, run_dir, console)
        (run_dir / "recipe.yaml").write_text(dump_recipe(recipe))
    except BaseException:
        trainer.close()
        raise
    run = StartedRun(
        trainer,
        JsonlWriter(run_dir / "metrics.jsonl"),
        Timeline(run_dir / "timeline.jsonl"),
        start_version=trainer.version,
    )
    try:
        # Trackers before the engine: one that cannot start fails the run before any generation.
        run.trackers = open_trackers(
            recipe,
            run_dir,
            tokenizer,
            warner(console, run_dir, prefix),
            resume_step=trainer.version if resume else None,
            group=group,
        )
        run.pool = pool = engines.pool(run.timeline, warner(console, run_dir, prefix))
        # Serial modes stay on-policy: all engines hold the new version before the next batch.
        run.push = push = FleetPush(
            mode.push,
            recipe.adapter.type,
            pool,
            recipe.engine.flip,
            wait_all=mode.serial,
            timeline=run.timeline,
            wait_s=recipe.rollout.stall_timeout_s,
        )
        push.initial(trainer)
        run.revival = engines.revival(pool, push)
        batch_groups = recipe.rollout.prompts_per_step
        signal = Signal(recipe.algorithm, recipe.rollout.max_new_tokens)
        per_engine = recipe.engine.max_inflight * recipe.engine.engines
        pipeline = Pipeline(
            pool,
            batch_groups,
            mode.max_staleness(recipe.max_staleness),
            recipe.rollout.group_size,
            # A serial batch is one barrier: submit all of it at once.
            max_inflight=max(per_engine, batch_groups * recipe.rollout.group_size)
            if mode.serial
            else per_engine,
            replenish=recipe.rollout.replenish,
            start_group=int(run_state.get("next_group", trainer.version * batch_groups)),
            start_version=trainer.version,
            keep=signal.carries if recipe.algorithm.dynamic_sampling else None,
            stood_aside=bool(run_state.get("filter_stood_aside", False)),
            filter_limit=recipe.algorithm.filter_limit,
            screen=(
                Screen(recipe.algorithm.screen, signal, recipe.algorithm.screen_from)
                if recipe.algorithm.screen
                else None
            ),
            max_lost_frac=recipe.rollout.max_lost_frac,
            on_warning=warner(console, run_dir, prefix),
        )
        # a sweep's runs share their engines: no run lends or borrows them
        cores = lendable_cores(recipe) if name is None else None
        if cores is not None:
            trainer.share_cores(cores)
            pipeline.on_idle = cores.engines_idle
        pipeline.on_wait = trainer_lends(recipe, pool) if name is None else None
        sampling = sampling_params(recipe.rollout, stop_ids)
        agents = None
        if is_agent(task):  # its episodes call the endpoint, which generates through the pool
            run.endpoint = agent_endpoint(recipe, tokenizer, pool, pipeline)
            agents = AgentRunner(run.endpoint, task, sampling, recipe.rollout.episode_timeout_s)
        run.producer = producer = Producer(
            pipeline,
            pool,
            task,
            sampling,
            recipe.seed,
            timeline=run.timeline,
            max_attempts=recipe.rollout.max_attempts,
            adapter=name,
            agents=agents,
            on_lost=warner(console, run_dir, prefix),
        )
        if run.endpoint is not None:
            run.endpoint.on_completion = producer.record
        if not mode.serial:
            pipeline.grant((recipe.trainer.steps - trainer.version) * batch_groups)
        producer.start()
        interrupts.raise_if_dropped()
    except BaseException:
        shut_down(run)
        trainer.close()
        run.close_files()
        raise
    run.parts = LoopParts(
        mode=mode,
        pool=pool,
        trainer=trainer,
        pipeline=pipeline,
        push=push,
        metrics=run.metrics,
        timeline=run.timeline,
        run_dir=run_dir,
        steps=recipe.trainer.steps,
        prompts_per_step=batch_groups,
        save_every=recipe.trainer.save_every,
        keep_last=recipe.trainer.keep_last,
        console=console,
        live=live,
        stall_s=recipe.rollout.stall_timeout_s,
        run_state=pipeline.run_state,
        trackers=run.trackers,
        label=prefix,
        signal=signal,
        logprob_warn=logprob_warn(recipe.engine.dtype, recipe.trainer.dtype),
    )
    return run


def agent_endpoint(recipe: Recipe, tokenizer, pool: EnginePool, pipeline: Pipeline) -> Endpoint:
    """The OpenAI-compatible endpoint an agent task's episodes call, in front of the run's pool."""

    def submit(ids, sampling, slot, engine, meta):
        return pool.generate(ids, sampling, slot=slot, engine=engine, meta=meta)

    return Endpoint(
        tokenizer,
        submit,
        model=Path(recipe.model).name,
        max_context=pool.info.max_context,
        max_attempts=recipe.rollout.max_attempts,
        on_aborted=lambda tokens: pipeline.count(aborted_tokens=tokens),
    ).start()


def _resume(trainer: Trainer, run_dir: Path, console: Console) -> dict:
    """The trainer as its newest complete checkpoint left it; metrics and samples of later steps set
    aside. Returns the run's saved state (where the prompt stream stands)."""
    run_state = {}
    source = checkpoint.latest(run_dir)
    if source is None:  # it stepped, but was stopped before its first checkpoint was complete
        console.print(
            f"resuming {run_dir} from the start: no checkpoint of it was complete", highlight=False
        )
    else:
        run_state = trainer.load(source)
        console.print(
            f"resuming {run_dir} from its newest complete checkpoint, "
            f"{source.relative_to(run_dir)} (step {trainer.version})",
            highlight=False,
        )
    drop_lines_after(run_dir / "metrics.jsonl", trainer.version)
    # samples.jsonl likewise, so that no step's samples appear twice after the resumed run's own.
    drop_lines_after(run_dir / "samples.jsonl", trainer.version, by_step=True)
    return run_state


def finish(run: StartedRun, recipe: Recipe, run_dir: Path, created: bool, resume: bool) -> None:
    """Run the steps; however they end, stop the engine and leave a run that agrees with itself. A
    run that cannot go on raises RunStopped, its way of ending judged by orbit/run/ends.py; Ctrl-C,
    Interrupted."""
    trainer = run.trainer
    try:
        run_steps(run.loop)
        # the last version reaches the engines; refusals surface
        run.loop.push.finish(recipe.rollout.stall_timeout_s)
    except KeyboardInterrupt:
        interrupts.handled()
        lost = trainer.ranks.lost
        if lost is not None:  # the heartbeat interrupted the run: a rank is gone
            saved = _stop_and_save(run, run_dir, created, resume)
            raise RunStopped(
                f"{sentence(f'a trainer rank was lost: {lost}')}\n{saved}", "rank-lost"
            ) from None
        if not _stop(run, run_dir, created, resume):
            raise Interrupted(
                f"interrupted before the first step: nothing was trained{left(run_dir, resume)}"
            ) from None
        raise Interrupted(
            f"interrupted at step {trainer.version}: {saved_line(run_dir, trainer.version)}",
            trainer.version,
        ) from None
    except Exception as err:
        verdict = judge(err)
        # saving again would fail again
        if verdict is not None and verdict.end.name == "save-failed":
            shut_down(run)
            raise RunStopped(
                f"{sentence(verdict.reason)}\ncontinue with `orbit train RECIPE --resume "
                f"{run_dir}` once the directory can be written",
                "save-failed",
            ) from err
        saved = _stop_and_save(run, run_dir, created, resume)
        if verdict is None:
            # no way a run ends, a bug: its traceback is the report (what was trained is saved)
            raise
        raise RunStopped(f"{sentence(verdict.reason)}\n{saved}", verdict.end.name) from err
    shut_down(run)


def _stop_and_save(run: StartedRun, run_dir: Path, created: bool, resume: bool) -> str:
    """`_stop`, and the line that says what was saved."""
    if _stop(run, run_dir, created, resume):
        return saved_line(run_dir, run.trainer.version)
    return f"nothing was trained{left(run_dir, resume)}"


def _stop(run: StartedRun, run_dir: Path, created: bool, resume: bool) -> bool:
    """Stop generation; checkpoint what was trained. Returns False (and removes the run's files,
    unless resumed) when this run never completed a step."""
    shut_down(run)
    if run.trainer.version == run.start_version:
        run.close_files()  # before the trackers' directories go
        undo_start(run_dir, created, resume)
        return False
    if run.parts is not None:
        save_checkpoint(run.parts)
    return True


def shut_down(run: StartedRun) -> None:
    """Stop submitting and updating, then stop the engines (which abort what is in flight). Never
    raises: a dead engine must not hide the real outcome."""
    if run.producer is not None:
        run.producer.stop()
        run.producer = None
    if run.push is not None:
        run.push.stop()
    if run.endpoint is not None:  # before the engines: no call is left waiting on one
        run.endpoint.stop()
        run.endpoint = None
    pool, run.pool = run.pool, None
    if pool is not None:
        try:
            pool.shutdown()
        except Exception:  # noqa: BLE001 - see above
            pass
    # after the pool: an engine that comes back now is stopped, not taken in
    if run.revival is not None:
        run.revival.stop()
