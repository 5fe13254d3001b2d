"""`orbit train`: build the pieces a recipe names, run the loop, and always leave a usable run.

A run directory holds `recipe.yaml`, `metrics.jsonl`, `timeline.jsonl` and `adapter/` (peft's
format plus optimizer state). Ctrl-C stops cleanly: the engine is paused and shut down, the
adapter saved, metrics flushed; `--resume RUN_DIR` continues from the last checkpoint.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from transformers import AutoTokenizer

from orbit.config import Recipe, RecipeError, dump_recipe
from orbit.engine import start_engine
from orbit.loop import LoopParts, run_steps
from orbit.metrics import JsonlWriter, Timeline
from orbit.modes import MODES
from orbit.rollout.buffer import GroupBuffer
from orbit.rollout.groups import sampling_params
from orbit.rollout.producer import Producer, max_ahead_groups
from orbit.sync import make_push
from orbit.tasks import TaskError, make_task
from orbit.train.trainer import Trainer


class Interrupted(Exception):
    """Ctrl-C during training; the run was saved."""

    def __init__(self, step: int, run_dir: Path) -> None:
        super().__init__(
            f"interrupted at step {step}: adapter saved to {run_dir / 'adapter'}; "
            f"continue with `orbit train RECIPE --resume {run_dir}`"
        )
        self.step = step


@dataclass
class RunResult:
    run_dir: Path
    steps_done: int
    seconds: float


def prepare_run_dir(run_dir: Path, resume: bool) -> None:
    """Refuse to mix two runs in one directory; resuming needs a checkpoint."""
    if resume:
        if not (run_dir / "adapter" / "trainer_state.json").exists():
            raise RecipeError(f"--resume: {run_dir} has no checkpoint (expected {run_dir}/adapter/)")
    elif (run_dir / "metrics.jsonl").exists():
        raise RecipeError(
            f"out: {run_dir} already holds a run; pass --resume {run_dir} to continue it or choose another --out"
        )
    run_dir.mkdir(parents=True, exist_ok=True)


def stop_token_ids(tokenizer, stop: list[str]) -> tuple[int, ...]:
    """eos plus the recipe's stop strings, each of which must be exactly one token."""
    ids = [tokenizer.eos_token_id]
    for text in stop:
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) != 1:
            raise RecipeError(f"rollout.stop: {text!r} is {len(encoded)} tokens {encoded} for this tokenizer; "
                              "each stop string must be exactly one token")
        ids.append(encoded[0])
    return tuple(ids)


def train(recipe: Recipe, resume: bool = False, live: bool = True, console: Console | None = None) -> RunResult:
    console = console or Console()
    run_dir = Path(recipe.out)
    # The task first: a bad task (import path, dataset row, option) fails before any compute.
    tokenizer = AutoTokenizer.from_pretrained(recipe.model)
    task = make_task(recipe.task, tokenizer)
    stop_ids = stop_token_ids(tokenizer, recipe.rollout.stop)
    prepare_run_dir(run_dir, resume)
    (run_dir / "recipe.yaml").write_text(dump_recipe(recipe))
    mode = MODES[recipe.mode]
    t0 = time.time()

    trainer = Trainer(recipe.model, recipe.adapter, recipe.trainer, recipe.rollout.temperature, recipe.seed)
    if resume:
        trainer.load(run_dir / "adapter")
    metrics = JsonlWriter(run_dir / "metrics.jsonl")
    timeline = Timeline(run_dir / "timeline.jsonl")
    engine = start_engine(recipe.engine, recipe.model, recipe.seed, recipe.adapter)
    producer = None
    start_version = trainer.version
    try:
        push = make_push(mode.push, recipe.adapter.type, engine)
        push.initial(engine, trainer)
        batch_groups = recipe.rollout.prompts_per_step
        serial = mode.loop == "serial"
        buffer = GroupBuffer(None if serial else recipe.max_staleness)
        producer = Producer(
            engine, task, sampling_params(recipe.rollout, stop_ids),
            recipe.rollout.group_size, buffer,
            # A serial batch is one barrier: submit all of it at once.
            max_inflight=max(recipe.engine.max_inflight, batch_groups * recipe.rollout.group_size)
            if serial else recipe.engine.max_inflight,
            max_ahead=max_ahead_groups(batch_groups, recipe.max_staleness if not serial else 0),
            seed=recipe.seed + 7919 * trainer.version,  # a resumed run continues with new prompts
            timeline=timeline,
        )
        buffer.on_take = producer.wake
        if not serial:
            producer.grant((recipe.trainer.steps - trainer.version) * batch_groups)
            if recipe.rollout.replenish:
                buffer.on_drop = producer.grant  # replace every stale group dropped
        producer.start()
        parts = LoopParts(
            mode=mode, engine=engine, trainer=trainer, producer=producer, buffer=buffer, push=push,
            metrics=metrics, timeline=timeline, run_dir=run_dir, steps=recipe.trainer.steps,
            prompts_per_step=batch_groups, save_every=recipe.trainer.save_every, console=console, live=live,
        )
        try:
            run_steps(parts)
        except KeyboardInterrupt:
            _stop_and_save(engine, producer, trainer, run_dir)
            producer = None  # already shut down
            raise Interrupted(trainer.version, run_dir) from None
        except RuntimeError as err:
            if not isinstance(err.__cause__, TaskError):
                raise
            # The task failed (its tool or verifier raised): stop, keeping metrics and a checkpoint.
            _stop_and_save(engine, producer, trainer, run_dir)
            producer = None  # already shut down
            raise TaskError(
                f"{err.__cause__}\nthe run stopped after step {trainer.version}; {run_dir} keeps metrics.jsonl, "
                f"timeline.jsonl and the adapter of step {trainer.version} (adapter/)"
            ) from err.__cause__
    finally:
        if producer is not None:
            _shutdown(engine, producer)
        metrics.close()
        timeline.close()
    return RunResult(run_dir, trainer.version - start_version, time.time() - t0)


def _stop_and_save(engine, producer: Producer, trainer: Trainer, run_dir: Path) -> None:
    """A run cut short: stop generation, then checkpoint what was trained."""
    _shutdown(engine, producer)
    trainer.save(run_dir / "adapter")


def _shutdown(engine, producer: Producer) -> None:
    """Stop submitting, abort what is in flight, stop the engine process."""
    producer.stop()
    try:
        engine.pause_generation("abort")
    except Exception:  # noqa: BLE001 - a dead engine must not hide the real outcome
        pass
    engine.shutdown()
