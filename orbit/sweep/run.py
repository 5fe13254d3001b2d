"""`orbit sweep`: K runs of one recipe trained at once, on one base, one set of engines and one
trainer.

- **Shared**: the trainer holds the base once with the K adapters side by side
  (orbit/train/shared.py); the
  engines are started once with K rings of slots, and every run's requests are batched together on
  them.
- **Each run is a single run** (orbit/run/lifecycle.py's `start` and `finish`, on its own thread):
  its own directory
  (recipe.yaml, metrics.jsonl, samples.jsonl, timeline.jsonl, checkpoints: `orbit train --resume`
  and `orbit eval` take it as they take any run's), optimizer, version, staleness bound, admission
  and double-buffered slots (orbit/sweep/lanes.py), flipped on its own.
- **Isolation**: a run that fails (a NaN loss, a refused push, its task) stops alone, saved, with
  its reason
  on the console and in its run.log; the others go on. An engine's death stops every run, each
  saved.
- **Ctrl-C** stops every run: each finishes the step it is in, writes its line and saves.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TypeVar

from rich.console import Console

from orbit.config import AdapterConfig, Recipe, RecipeError
from orbit.engine import EngineStarter, start_engines, stop_engines
from orbit.engine.base import Engine
from orbit.host import interrupts
from orbit.host.threads import compute_threads
from orbit.rl.truncation import truncates
from orbit.run.directory import prepare_run_dir, resumable, undo_start
from orbit.run.ends import judge
from orbit.run.lifecycle import StartedRun, finish, shut_down, start
from orbit.run.placement import colocate
from orbit.run.preflight import stop_token_ids
from orbit.sweep.lanes import SharedEngines
from orbit.sweep.plan import SWEEP_FILE, SweepPlan, dump_sweep
from orbit.sweep.watch import RunStatus, SweepTable, print_summary, summarize
from orbit.tasks import TaskError, close_task, make_task
from orbit.train.packed import StepPacker
from orbit.train.shared import SharedBase
from orbit.train.trainer import recipe_trainer

T = TypeVar("T")


@dataclass
class SweepResult:
    out: Path
    statuses: list[RunStatus]
    seconds: float
    engine_busy_frac: float  # the engines' busy time over the sweep's wall time, per engine
    interrupted: bool = False

    @property
    def failed(self) -> list[RunStatus]:
        return [s for s in self.statuses if s.state == "stopped"]


@dataclass
class _Lane:
    status: RunStatus
    recipe: Recipe
    run: StartedRun
    created: bool
    resume: bool


def _few_malloc_arenas(arenas: int = 2) -> None:
    """Each run trains on a thread of its own, and glibc gives each thread an arena of its own that
    keeps what a step freed: K runs held K steps' worth of activations (12.0 GB for 7 SmolLM2 runs
    after 3 steps, 5.6 GB with 2 arenas: bench/algorithms.py). Capped before the threads start;
    elsewhere than glibc, nothing."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-8, arenas)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


def sweep(
    plan: SweepPlan, resume: bool = False, live: bool = True, console: Console | None = None
) -> SweepResult:
    """Train every run of the plan to its last step (or until it fails, or Ctrl-C)."""
    console = console or Console()
    t0 = time.time()
    _few_malloc_arenas()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(plan.recipe.model)
    tasks = []
    try:
        # every task first: a bad one fails before any compute, naming its run
        for run in plan.runs:
            tasks.append(_named(run.name, partial(make_task, run.recipe.task, tokenizer)))
        stops = [
            _named(r.name, partial(stop_token_ids, tokenizer, r.recipe.rollout.stop))
            for r in plan.runs
        ]
        interrupts.raise_if_dropped()
        resumes = [resume and resumable(r.run_dir) for r in plan.runs]
        if resume and not any(resumes):
            raise RecipeError(
                f"--resume: no run of this sweep in {plan.out} completed a step; start it without "
                "--resume"
            )
        created = _prepare(plan, resumes)
        (plan.out / SWEEP_FILE).write_text(dump_sweep(plan))
        lanes, engines = _start(plan, tasks, stops, resumes, created, console, tokenizer)
        try:
            busy0, t_run = _busy(engines), time.time()
            interrupted = _run_lanes(lanes, live, console)
            busy = (_busy(engines) - busy0) / max(time.time() - t_run, 1e-9) / len(engines)
        finally:
            stop_engines(engines)
    finally:
        for task in tasks:
            close_task(task)
    statuses = [lane.status for lane in lanes]
    ranked = summarize(plan.out, statuses, {"engine_busy_frac": busy, "seconds": time.time() - t0})
    print_summary(console, ranked, plan.out)
    return SweepResult(plan.out, statuses, time.time() - t0, busy, interrupted)


def _named(name: str, make: Callable[[], T]) -> T:
    """`make()`, its error naming the run it was for."""
    try:
        return make()
    except TaskError as err:
        raise TaskError(f"{name}: {err}") from None
    except RecipeError as err:
        raise RecipeError(f"{name}: {err}") from None


def _prepare(plan: SweepPlan, resumes: list[bool]) -> list[bool]:
    """Each run's directory, as `orbit train` prepares one; if one holds another run, none is left
    created."""
    created: list[bool] = []
    try:
        plan.out.mkdir(parents=True, exist_ok=True)
        for run, again in zip(plan.runs, resumes, strict=True):
            created.append(prepare_run_dir(run.run_dir, again))
    except RecipeError as err:
        for run, made in zip(plan.runs, created, strict=False):
            undo_start(run.run_dir, made, False)
        raise RecipeError(f"{err}\n(a sweep continues with `orbit sweep ... --resume`)") from None
    return created


def _start(
    plan: SweepPlan,
    tasks: list,
    stops: list,
    resumes: list[bool],
    created: list[bool],
    console: Console,
    tokenizer,
) -> tuple[list[_Lane], list[Engine]]:
    """The engines (K rings of slots), the shared base and each run started on them. A failure stops
    what started and leaves the run directories as they were."""
    recipe, k = plan.recipe, len(plan.runs)
    engine_cfg, note = colocate(recipe, 1)
    if note:
        console.print(note, highlight=False)
    engine_cfg = engine_cfg.model_copy(update={"slots": k * recipe.engine.slots})
    starter = EngineStarter(
        engine_cfg,
        recipe.model,
        recipe.seed,
        _widest(plan),
        call_timeout_s=recipe.rollout.stall_timeout_s,
        truncated=any(
            truncates(r.recipe.rollout.top_p, r.recipe.rollout.top_k)
            and r.recipe.rollout.temperature > 0
            for r in plan.runs
        ),
    )
    lanes: list[_Lane] = []
    engines: list[Engine] = []
    try:
        # first: a server that cannot hold K rings of slots says so at once
        engines = start_engines(starter)
        base = SharedBase(recipe.model, recipe.trainer.dtype)
        if recipe.trainer.pack:
            base.packer = StepPacker(base)
        for i, (planned, task, stop_ids) in enumerate(zip(plan.runs, tasks, stops, strict=True)):
            r = planned.recipe
            trainer = recipe_trainer(r, shared=base, name=f"run{i}")
            shared = SharedEngines(engines, starter.capacities(), i, recipe.engine.slots)
            run = start(
                r,
                planned.run_dir,
                resumes[i],
                task,
                stop_ids,
                console,
                False,
                trainer,
                shared,
                tokenizer,
                name=planned.name,
                group=plan.out.name,
            )
            status = RunStatus(planned.name, planned.run_dir, r.trainer.steps)
            run.loop.on_step = status.stepped
            lanes.append(_Lane(status, r, run, created[i], resumes[i]))
    except BaseException:
        for lane in lanes:
            shut_down(lane.run)
            lane.run.close_files()
        stop_engines(engines)
        for planned, made, again in zip(plan.runs, created, resumes, strict=True):
            undo_start(planned.run_dir, made, again)
        raise
    return lanes, engines


def _widest(plan: SweepPlan) -> AdapterConfig:
    """The adapter the engines must make room for: every run's rank and target modules (SGLang fixes
    them at start)."""
    adapters = [r.recipe.adapter for r in plan.runs]
    targets = sorted({m for a in adapters for m in a.target_modules})
    return adapters[0].model_copy(
        update={"r": max(a.r for a in adapters), "target_modules": targets}
    )


def _run_lanes(lanes: list[_Lane], live: bool, console: Console) -> bool:
    """Each run's loop on a thread of its own, the live table on this one, until every run has
    ended. Ctrl-C interrupts every run's pipeline: each finishes its step and saves. Returns whether
    Ctrl-C stopped them."""
    threads = [
        threading.Thread(
            target=_lane_main, args=(lane, console), name=f"orbit-sweep-{i}", daemon=True
        )
        for i, lane in enumerate(lanes)
    ]
    stop = threading.Event()

    def ctrl_c(signum, frame) -> None:  # noqa: ARG001 - signal handler signature
        if not stop.is_set():
            sys.stderr.write("\nCtrl-C: every run finishes its step and saves\n")
        stop.set()
        for lane in lanes:
            lane.run.loop.pipeline.interrupt()

    # Held as a flag for the whole phase, not raised: a KeyboardInterrupt between two statements
    # here would stop the engines under runs still training.
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, ctrl_c) if main else None
    try:
        with SweepTable([lane.status for lane in lanes], enabled=live) as table:
            for thread in threads:
                thread.start()
            while any(t.is_alive() for t in threads):
                time.sleep(0.25)
                table.refresh()
    finally:
        # this thread failed: the runs stop and save before the engines go
        if any(t.is_alive() for t in threads):
            ctrl_c(signal.SIGINT, None)
            for thread in threads:
                thread.join()
        if main:
            signal.signal(signal.SIGINT, previous)
    return stop.is_set()


def _lane_main(lane: _Lane, console: Console) -> None:
    """One run's loop (orbit/run/lifecycle.py's `finish`); however it ends, its status says how and
    why."""
    status, run = lane.status, lane.run
    compute_threads(lane.recipe.trainer.threads)  # this thread trains (orbit/host/threads.py)
    trace = ""
    try:
        finish(run, lane.recipe, status.run_dir, lane.created, lane.resume)
        status.end("done")
    except BaseException as err:  # noqa: BLE001 - one run's failure is that run's alone
        verdict = judge(err)
        if verdict is None:  # no way a run ends (a bug): the traceback goes to its run.log
            status.end("stopped", f"{type(err).__name__}: {err}")
            trace = traceback.format_exc()
        else:
            status.end("interrupted" if verdict.end.code == 130 else "stopped", verdict.reason)
    finally:
        run.trainer.close()
        run.close_files()
    if status.state == "stopped":
        console.print(
            f"[bold red]{status.name} stopped[/] (the other runs go on): {status.reason}",
            highlight=False,
        )
        # a run stopped before its first step left none
        status.run_dir.mkdir(parents=True, exist_ok=True)
        with (status.run_dir / "run.log").open("a") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} STOPPED {status.reason}\n{trace}")


def _busy(engines: list[Engine]) -> float:
    total = 0.0
    for engine in engines:
        try:
            total += engine.stats().busy_s
        except Exception:  # noqa: BLE001 - a dead engine's time is not counted
            pass
    return total
