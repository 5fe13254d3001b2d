"""The RL loop: rollouts → train → push, one step at a time. One loop for all five modes.

The loop kind only changes where a batch comes from: `serial` grants one batch per step and
waits for all of it (and offloads the engine while training); `overlapped` has the producer run
ahead all the time and takes complete groups as they arrive. The push is the mode's strategy.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean

from rich.console import Console

from orbit.engine.base import Engine
from orbit.metrics import JsonlWriter, LiveView, StepMetrics, Timeline
from orbit.modes import Mode
from orbit.rollout.buffer import GroupBuffer
from orbit.rollout.producer import Producer
from orbit.sync import Push
from orbit.train.trainer import Trainer

LOGPROB_WARN = 1e-2  # engine and trainer disagree on the same tokens by more than rounding


@dataclass
class LoopParts:
    mode: Mode
    engine: Engine
    trainer: Trainer
    producer: Producer
    buffer: GroupBuffer
    push: Push
    metrics: JsonlWriter
    timeline: Timeline
    run_dir: Path
    steps: int
    prompts_per_step: int
    save_every: int
    console: Console
    live: bool = True


def run_steps(p: LoopParts) -> None:
    """Train from the trainer's current version up to `p.steps`."""
    serial = p.mode.loop == "serial"
    with LiveView(p.mode.name, p.steps, p.trainer.version, enabled=p.live) as view:
        while p.trainer.version < p.steps:
            m, flipped = one_step(p, serial)
            p.metrics.write(m.to_json())
            view.update(m, flipped)
            if m.logprob_diff is not None and m.logprob_diff > LOGPROB_WARN:
                p.console.print(
                    f"[bold red]WARNING[/] step {m.step}: engine and trainer logprobs differ by "
                    f"{m.logprob_diff:.3g} (> {LOGPROB_WARN}) on the same tokens"
                )


def one_step(p: LoopParts, serial: bool) -> tuple[StepMetrics, bool]:
    t_step = time.time()
    version = p.trainer.version
    before = p.engine.stats()
    resubmitted = p.producer.resubmitted

    # 1. Rollouts: a batch of complete groups, fresh enough for this version.
    if serial:
        p.producer.grant(p.prompts_per_step)
    with p.timeline.span("trainer", "wait", version) as wait:
        batch = p.buffer.take(p.prompts_per_step, version)
    samples = batch.samples
    staleness = [s.staleness(version) for s in samples]

    # 2. Train on it (a serial engine is idle now: give its memory back meanwhile).
    if serial:
        p.engine.release_memory()
    with p.timeline.span("trainer", "train", version) as train:
        result = p.trainer.step(samples)
    if serial:
        p.engine.resume_memory()

    # 3. Push the new version to the engine.
    with p.timeline.span("trainer", "push", p.trainer.version, push=p.push.name):
        pushed = p.push.push(p.engine, p.trainer, p.timeline)

    if p.trainer.version % p.save_every == 0 or p.trainer.version >= p.steps:
        with p.timeline.span("trainer", "save", p.trainer.version):
            p.trainer.save(p.run_dir / "adapter")

    after = p.engine.stats()
    step_s = time.time() - t_step
    tokens = after.tokens_generated - before.tokens_generated
    m = StepMetrics(
        mode=p.mode.name,
        step=version,
        version=p.trainer.version,
        update_weights_s=pushed.seconds,
        train_wait_s=wait.seconds,
        rollout_tok_per_dev_s=tokens / step_s,  # one engine device (process or GPU)
        step_s=step_s,
        staleness_mean=fmean(staleness),
        staleness_max=max(staleness),
        engine_paused_s=after.paused_s - before.paused_s,
        logprob_diff=_finite(result.logprob_diff),
        reward_mean=fmean(s.reward for s in samples),
        loss=result.loss,
        stale_dropped=batch.stale_dropped,
        train_s=train.seconds,
        tokens_generated=tokens,
        logprob_diff_tokens=result.logprob_diff_tokens,
        policy_drift=_finite(result.policy_drift),
        grad_norm=result.grad_norm,
        full_push=pushed.full,
        merged_push=pushed.merged,
        resubmitted=p.producer.resubmitted - resubmitted,
    )
    return m, pushed.flipped


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None
