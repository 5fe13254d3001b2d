"""The RL loop: rollouts → train → push, one step at a time. One loop for all five modes.

The loop kind only changes where a batch comes from: `serial` grants one batch per step and
waits for all of it (and offloads the engine while training); `overlapped` has the producer run
ahead all the time and takes complete groups as they arrive. The push is the mode's strategy.

Every optimizer step that reaches the adapter gets its metrics line: Ctrl-C is held from the
start of the optimizer step until the line is written, and a push that fails (a dead engine)
writes the step's line before the error goes on. So the saved adapter's version and the last
metrics line always agree, and `--resume` neither skips nor repeats a step.
"""

from __future__ import annotations

import math
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Any

from rich.console import Console

from orbit.config.modes import Mode
from orbit.engine.base import EngineStats
from orbit.engine.pool import EnginePool
from orbit.host import interrupts
from orbit.metrics.steps import JsonlWriter, LiveView, StepMetrics, Timeline
from orbit.push.fleet import FleetPush
from orbit.push.phases import PushResult
from orbit.rollout.groups import Signal
from orbit.rollout.pipeline import Batch, Pipeline
from orbit.rollout.sample import Sample
from orbit.run.trackers import Trackers
from orbit.train import checkpoint
from orbit.train.trainer import StepResult, Trainer

# engine and trainer disagree on the same tokens by more than rounding: float32 agrees to about
# 1e-6; bfloat16 (8 bits of mantissa) differs by about 1e-2 between two kernels with no fault
# (SGLang's Triton attention against the trainer's, bench/investigations/sglang-gpu.md)
LOGPROB_WARN = {"float32": 1e-2, "bfloat16": 5e-2, "float16": 5e-2}


def logprob_warn(*dtypes: str) -> float:
    """The warning's threshold for engines and a trainer in these dtypes: the coarsest one's."""
    return max(LOGPROB_WARN[d] for d in dtypes)


@dataclass
class LoopParts:
    mode: Mode
    pool: EnginePool
    trainer: Trainer
    pipeline: Pipeline
    push: FleetPush
    metrics: JsonlWriter
    timeline: Timeline
    run_dir: Path
    steps: int
    prompts_per_step: int
    save_every: int
    keep_last: int
    console: Console
    signal: Signal  # the algorithm's rewards, filters and advantages
    live: bool = True
    stall_s: float | None = None  # rollout.stall_timeout_s
    # what a checkpoint keeps besides the trainer (the prompt stream's place)
    run_state: Callable[[], dict] = dict
    # samples.jsonl, TensorBoard, W&B: each step's line and a few samples
    trackers: Trackers | None = None
    # a sweep's live table (orbit/sweep/watch.py)
    on_step: Callable[[StepMetrics], None] | None = None
    label: str = ""  # a sweep's run, "NAME: ", before its console lines
    logprob_warn: float = LOGPROB_WARN["float32"]  # logprob_warn(engine's dtype, trainer's)


def run_steps(p: LoopParts) -> None:
    """Train from the trainer's current version up to `p.steps`."""
    serial = p.mode.serial
    with LiveView(p.mode.name, p.steps, p.trainer.version, enabled=p.live) as view:
        while p.trainer.version < p.steps:
            # a Ctrl-C that Python dropped (it landed in a callback) stops the run here
            interrupts.raise_if_dropped()
            m, flipped = one_step(p, serial)
            view.update(m, flipped, p.pool.versions())
            if p.on_step is not None:
                p.on_step(m)
            if m.logprob_diff is not None and m.logprob_diff > p.logprob_warn:
                p.console.print(
                    f"[bold red]WARNING[/] {p.label}step {m.step}: engine and trainer logprobs "
                    f"differ by {m.logprob_diff:.3g} (> {p.logprob_warn}) on the same tokens"
                )


def one_step(p: LoopParts, serial: bool) -> tuple[StepMetrics, bool]:
    t_step = time.time()
    version = p.trainer.version
    before = p.pool.stats()
    c = p.pipeline.counts
    counts = (c.resubmitted, c.aborted_tokens, c.filtered, c.episodes_lost, c.screened)
    signal = p.signal

    # 1. Rollouts: a batch of complete groups, fresh enough for this version.
    if serial:
        p.pipeline.grant(p.prompts_per_step)
    with p.timeline.span("trainer", "wait", version) as wait:
        batch = p.pipeline.take(p.prompts_per_step, version, stall_s=p.stall_s)
    samples = batch.samples
    signal.set_advantages(batch.groups)

    with HeldInterrupt():
        # 2. Train on it (a serial engine is idle now: give its memory back meanwhile).
        if serial:
            p.pool.release_memory()
        with p.timeline.span("trainer", "train", version) as train:
            result = p.trainer.step(samples)

        # 3. Push the new version to the engine. The step reached the adapter: whatever happens
        #    now, its line is written before an error goes on.
        t_push = time.time()
        failure: Exception | None = None
        try:
            if serial:
                p.pool.resume_memory()
            with p.timeline.span("trainer", "push", p.trainer.version, push=p.push.name):
                pushed = p.push.push(p.trainer)
        except Exception as err:  # noqa: BLE001 - re-raised below, after the line
            failure, pushed = err, PushResult(time.time() - t_push, 0.0)

        m = _metrics(
            p,
            version,
            t_step,
            wait.seconds,
            train.seconds,
            batch,
            samples,
            result,
            pushed,
            before,
            _stats_or(p.pool, before),
            counts,
            signal,
        )
        line = m.to_json()
        p.metrics.write(line)
        # 4. The checkpoint, after the line: a kill between the two leaves a line newer than the
        #    newest
        #    checkpoint, which --resume sets aside; the other order would lose the line of a saved
        # step.
        if failure is None and (
            p.trainer.version % p.save_every == 0 or p.trainer.version >= p.steps
        ):
            with p.timeline.span("trainer", "save", p.trainer.version):
                save_checkpoint(p)
    # Outside the held block: Ctrl-C need not wait for a tracker. The line is written either way,
    # and trackers never raise, so a failed push still reaches `raise failure`.
    if p.trackers is not None:
        p.trackers.log_step(line, samples)
    if failure is not None:
        raise failure
    return m, pushed.flipped


def save_checkpoint(p: LoopParts) -> None:
    """The trainer's state and the run's (the prompt stream's place) as the newest checkpoint."""
    state = p.run_state()
    checkpoint.save(
        p.run_dir,
        p.trainer.version,
        lambda directory: p.trainer.save(directory, state),
        p.keep_last,
    )


def _metrics(
    p: LoopParts,
    version: int,
    t_step: float,
    wait_s: float,
    train_s: float,
    batch: Batch,
    samples: list[Sample],
    result: StepResult,
    pushed: PushResult,
    before: EngineStats,
    after: EngineStats,
    counts: tuple[int, int, int, int, int],
    signal: Signal,
) -> StepMetrics:
    step_s = time.time() - t_step
    tokens = after.tokens_generated - before.tokens_generated
    engines = len(p.pool.members)  # the per-engine figures divide by all of them
    lag = p.push.flip_lag()
    trained_tokens = sum(sum(s.loss_mask) for s in samples)
    wasted = batch.dropped_tokens + p.pipeline.counts.aborted_tokens - counts[1]
    staleness = [s.staleness(version) for s in samples]
    filtered = p.pipeline.counts.filtered - counts[2]
    silent = sum(not signal.carries(g) for g in batch.groups) + filtered
    return StepMetrics(
        mode=p.mode.name,
        step=version,
        version=p.trainer.version,
        update_weights_s=pushed.seconds,
        train_wait_s=wait_s,
        rollout_tok_per_dev_s=tokens / step_s / engines,
        step_s=step_s,
        staleness_mean=fmean(staleness),
        staleness_max=max(staleness),
        engine_paused_s=after.paused_s - before.paused_s,
        logprob_diff=_finite(result.logprob_diff),
        reward_mean=fmean(s.reward for s in samples),
        loss=result.loss,
        stale_dropped=batch.stale_dropped,
        train_s=train_s - result.queue_s,
        trainer_queue_s=result.queue_s,
        trainer_packed=result.packed,
        trainer_idle_s=wait_s + pushed.seconds,
        engine_busy_s=after.busy_s - before.busy_s,
        tokens_generated=tokens,
        logprob_diff_tokens=result.logprob_diff_tokens,
        policy_drift=_finite(result.policy_drift),
        grad_norm=result.grad_norm,
        full_push=pushed.full,
        merged_push=pushed.merged,
        resubmitted=p.pipeline.counts.resubmitted - counts[0],
        ratio_mean=_finite(result.ratio_mean),
        ratio_max=_finite(result.ratio_max),
        clip_frac=_finite(result.clip_frac),
        trained_tokens=trained_tokens,
        waste_frac=wasted / tokens if tokens else 0.0,
        useful_tok_per_dev_s=trained_tokens / step_s / engines,
        flip_lag_s=lag[1] if lag is not None else None,
        engines_alive=len(p.pool.alive()),
        rejoined=p.pool.rejoined,
        pushes_refused=p.push.refusals,
        adapter_transport=p.pool.transports(),
        entropy=_finite(result.entropy),
        zero_variance_frac=silent / (len(batch.groups) + filtered),
        groups_filtered=filtered,
        groups_screened=p.pipeline.counts.screened - counts[4],
        episodes_lost=p.pipeline.counts.episodes_lost - counts[3],
        truncated_frac=sum(s.finish_reason == "length" for s in samples) / len(samples),
        masked_frac=result.masked_frac,
        lr=result.lr,
        optimizer_steps=result.optimizer_steps,
        trainer_tflops=result.flops / max(train_s - result.queue_s, 1e-9) / 1e12,
        borrowed_frac=result.borrowed_frac,
        extra=task_figures(samples),
    )


def task_figures(samples: list[Sample]) -> dict:
    """correct_rate, format_rate and failure-mode counts, for tasks whose scores say so."""
    out: dict = {}
    infos = [s.info for s in samples]
    for key, name in (("correct", "correct_rate"), ("format_ok", "format_rate")):
        known = [bool(i[key]) for i in infos if i.get(key) is not None]
        if known:
            out[name] = sum(known) / len(known)
    modes = Counter(i["failure_mode"] for i in infos if i.get("failure_mode") is not None)
    if modes:
        out["failure_modes"] = dict(sorted(modes.items()))
    return out


def _stats_or(pool: EnginePool, fallback: EngineStats) -> EngineStats:
    """The engines' counters, or the step's starting ones when they cannot answer (they died)."""
    try:
        return pool.stats()
    except Exception:  # noqa: BLE001 - the push's own error is the one to report
        return fallback


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


class HeldInterrupt:
    """Hold Ctrl-C (SIGINT, and SIGTERM where it stops a run the same way) for the duration of the
    block, then raise it.

    An optimizer step must not be cut between the update and its metrics line. Only the main
    thread can hold signals; elsewhere this does nothing. A second one is held too.
    """

    def __enter__(self) -> HeldInterrupt:
        self.pending = False
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                if interrupts.stops_the_run(signum):
                    self._previous[signum] = signal.signal(signum, self._hold)
        return self

    def _hold(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        if not self.pending:
            what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
            sys.stderr.write(
                f"\n{what}: finishing this step first (its adapter and metrics line must agree)\n"
            )
        self.pending = True

    def __exit__(self, exc_type, exc, tb) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        if self.pending and exc_type is None:
            raise KeyboardInterrupt
