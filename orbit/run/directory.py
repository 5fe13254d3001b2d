"""A run's directory: refusing to mix two runs in one, leaving nothing behind a run that never
stepped, setting aside what a resumed run's checkpoint does not hold, and its run.log of
warnings."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from orbit.config import RecipeError
from orbit.train import checkpoint

RUN_FILES = ("recipe.yaml", "metrics.jsonl", "timeline.jsonl", "run.log", "samples.jsonl")
RUN_DIRS = ("tensorboard", "wandb")  # the trackers' own files (recipe `logging`)


def resumable(run_dir: Path) -> bool:
    """Whether a run in `run_dir` completed a step: it has a checkpoint, or a metrics line."""
    return checkpoint.latest(run_dir) is not None or _has_lines(run_dir)


def _has_lines(run_dir: Path) -> bool:
    metrics = run_dir / "metrics.jsonl"
    return metrics.exists() and metrics.stat().st_size > 0


def prepare_run_dir(run_dir: Path, resume: bool) -> bool:
    """Refuse to mix two runs in one directory; resuming needs a checkpoint. Returns whether the
    directory was created here (a failed start removes it again)."""
    if resume:
        checkpoint.clean_partial(run_dir)  # what a save killed part-way left
        if not resumable(run_dir):
            if run_dir.is_dir():
                raise RecipeError(
                    f"--resume: {run_dir} never completed a step, so there is nothing to resume; "
                    "start it again without --resume"
                )
            raise RecipeError(
                f"--resume: {run_dir} has no checkpoint (expected {run_dir}/checkpoints/step-N/)"
            )
    elif (
        _has_lines(run_dir)
        or (run_dir / checkpoint.LATEST).exists()
        or (run_dir / checkpoint.CHECKPOINTS).exists()
    ):
        raise RecipeError(
            f"out: {run_dir} already holds a run; pass --resume {run_dir} to continue it or choose "
            "another --out"
        )
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    return created


def warner(console: Console, run_dir: Path, prefix: str = "") -> Callable[[str], None]:
    """Warnings (an engine leaving the pool, an agent episode lost): on the console (after `prefix`:
    a sweep's run) its first line, and in RUN_DIR/run.log the whole of it (a traceback)."""

    def warn(message: str) -> None:
        first, _, rest = message.partition("\n")
        more = " (the traceback is in run.log)" if rest else ""
        console.print(f"[bold yellow]WARNING[/] {prefix}{first}{more}", highlight=False)
        with (run_dir / "run.log").open("a") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} WARNING {message}\n")

    return warn


def saved_line(run_dir: Path, version: int) -> str:
    return (
        f"the adapter of step {version} is saved in {run_dir / checkpoint.LATEST}, metrics.jsonl "
        f"ends at that step; continue with `orbit train RECIPE --resume {run_dir}`"
    )


def left(run_dir: Path, resume: bool) -> str:
    return f" ({run_dir} is as it was)" if resume else f" (nothing left in {run_dir})"


def undo_start(run_dir: Path, created: bool, resume: bool) -> None:
    """A fresh run that never stepped leaves nothing in the way of running it again."""
    if resume:
        return
    for name in RUN_FILES:
        (run_dir / name).unlink(missing_ok=True)
    # a fresh run's directory held no run (prepare_run_dir), so these are its own
    for name in RUN_DIRS:
        shutil.rmtree(run_dir / name, ignore_errors=True)
    if created:
        try:
            run_dir.rmdir()
        except OSError:
            pass  # something else lives there now: leave it


def drop_lines_after(path: Path, version: int, by_step: bool = False) -> None:
    """Resuming from the checkpoint of `version`: metrics lines of later steps describe updates the
    checkpoint does not hold (the run died between checkpoints). They move to
    metrics.discarded.jsonl. `by_step`: lines that say their step, not the version it made
    (samples.jsonl, whose `version` is the sample's own): step s made version s + 1. They move to
    samples.discarded.jsonl."""
    if not path.exists():
        return
    keep: list[str] = []
    drop: list[str] = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        kept = row["step"] < version if by_step else row.get("version", 0) <= version
        (keep if kept else drop).append(line)
    if drop:
        with path.with_name(f"{path.stem}.discarded.jsonl").open("a") as f:
            f.write("\n".join(drop) + "\n")
        path.write_text("".join(x + "\n" for x in keep))
