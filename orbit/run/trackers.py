"""Watching a run: decoded samples in RUN_DIR/samples.jsonl, the metrics on TensorBoard and W&B.

metrics.jsonl stays the source of truth and the trackers are views of it. So a tracker that cannot
start fails the run before any compute (a RecipeError naming `logging`), but one that fails later
only warns, once, and the run goes on: losing a chart must never cost training.
"""

from __future__ import annotations

import html
import importlib.util
import json
import math
import os
import re
import shutil
from collections.abc import Callable, Iterable
from contextlib import suppress
from pathlib import Path

from orbit.config import Recipe, RecipeError
from orbit.metrics.steps import JsonlWriter
from orbit.rollout.sample import Sample

# recipe name -> (module to import, how to install it)
TRACKERS = {
    "tensorboard": ("tensorboard", "pip install tensorboard"),
    "wandb": ("wandb", "pip install wandb"),
}
INSTALL_BOTH = "pip install -c constraints.txt -e '.[track]'"
START_HINTS = {
    "wandb": " (log in with `wandb login`, or set WANDB_MODE=offline to log to RUN_DIR/wandb only)"
}
SAMPLES_PER_STEP = 16  # a few to read, not a dump: every step writes them
GROUPS_PER_STEP = 2  # whole GRPO groups, side by side on the live page (orbit/pages)
SAMPLE_COLUMNS = (
    "step",
    "version",
    "group",
    "prompt",
    "completion",
    "reward",
    "advantage",
    "failure_mode",
    "correct",
    "format_ok",
)


def tracker_problem(name: str) -> str | None:
    """Why the tracker `name` cannot run here, or None. Looks the module up without importing it
    (wandb takes a second to import); an import that still fails surfaces when the run starts."""
    module, install = TRACKERS[name]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if found:
        return None
    return (
        f"{module} is not installed in this Python environment; install it with: {install} (or "
        f"{INSTALL_BOTH})"
    )


def scalars(row: dict, prefix: str = "") -> dict[str, float]:
    """A metrics line as tracker scalars: numbers (bools as 0/1) by name, nested dicts flattened to
    `outer/inner` (failure_modes/success); None, strings and lists have no scalar and are left
    out."""
    out: dict[str, float] = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(scalars(value, f"{name}/"))
        elif isinstance(value, bool | int | float) and math.isfinite(value):
            out[name] = float(value)
    return out


def pick(
    samples: list[Sample], groups: int = GROUPS_PER_STEP, n: int = SAMPLES_PER_STEP
) -> list[Sample]:
    """The samples of the step's first `groups` groups, whole (a group's completions are read side
    by side: their rewards and advantages say why each is pushed up or down), at most `n`."""
    chosen = list(dict.fromkeys(s.group_id for s in samples))[:groups]
    return [s for s in samples if s.group_id in chosen][:n]


def sample_row(step: int, s: Sample, tokenizer) -> dict:
    """One samples.jsonl line. Special tokens are kept: an eos or a task's tag tokens are part of
    what the model wrote."""
    row = {
        "step": step,
        "version": s.version_start,
        "version_end": s.version_end,
        "group": s.group_id,
        "prompt": tokenizer.decode(s.prompt_ids, skip_special_tokens=False),
        "completion": tokenizer.decode(s.output_ids, skip_special_tokens=False),
        "reward": s.reward,
        "advantage": s.advantage,
        "failure_mode": s.info.get("failure_mode"),
        # token by token, for the live page: the text, whether it is trained, and |engine -
        # trainer| logprob
        "tokens": [tokenizer.decode([t], skip_special_tokens=False) for t in s.output_ids],
        "trained": [int(m) for m in s.loss_mask],
        "logprob_diff": None
        if s.trainer_logprobs is None
        else [
            round(abs(a - b), 7) if m else None
            for a, b, m in zip(s.trainer_logprobs, s.behaviour_logprobs, s.loss_mask, strict=False)
        ],
    }
    for key in ("correct", "format_ok"):
        if s.info.get(key) is not None:
            row[key] = s.info[key]
    return row


def markdown_table(rows: list[dict]) -> str:
    """The samples as a markdown table for TensorBoard's text tab."""
    lines = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + "---|" * len(SAMPLE_COLUMNS)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in SAMPLE_COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def _cell(value) -> str:
    # TensorBoard sanitises HTML: escaped, `<answer>` shows as text instead of vanishing as a tag.
    text = html.escape("" if value is None else str(value), quote=False)
    return re.sub(r"([\\`*_\[\]|#])", r"\\\1", text).replace("\n", "<br>")


class _TensorBoard:
    name = "tensorboard"

    def __init__(self, run_dir: Path, purge_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a resumed run hides the events of steps the checkpoint does not hold.
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge_step)

    def log(self, step: int, values: dict[str, float], rows: list[dict]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        if rows:
            self.writer.add_text("samples", markdown_table(rows), step)
        self.writer.flush()  # a live `tensorboard --logdir` sees each step as it ends

    def image(self, tag: str, path: Path, step: int) -> None:
        import numpy as np
        from PIL import Image

        with Image.open(path) as img:
            self.writer.add_image(tag, np.asarray(img.convert("RGB")), step, dataformats="HWC")

    def close(self) -> None:
        self.writer.close()


class _WandB:
    name = "wandb"

    def __init__(self, run_dir: Path, name: str, config: dict, group: str | None = None) -> None:
        import wandb

        self.wandb = wandb
        # No key and no mode here: login, WANDB_API_KEY and WANDB_MODE=offline are the user's. A
        # sweep's runs are W&B runs of one group, open side by side in this process ("create_new":
        # none ends another).
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "orbit"),
            name=name,
            dir=str(run_dir),
            config=config,
            group=group,
            reinit="create_new",
        )

    def log(self, step: int, values: dict[str, float], rows: list[dict]) -> None:
        data: dict = dict(values)
        if rows:
            data["samples"] = self.wandb.Table(
                columns=list(SAMPLE_COLUMNS),
                data=[[r.get(c) for c in SAMPLE_COLUMNS] for r in rows],
            )
        self.run.log(data, step=step)

    def image(self, tag: str, path: Path, step: int) -> None:
        self.run.log({tag: self.wandb.Image(str(path))}, step=step)

    def close(self) -> None:
        self.run.finish()


def open_backends(
    names: Iterable[str],
    run_dir: Path,
    config: dict,
    name: str | None = None,
    purge_step: int | None = None,
    group: str | None = None,
) -> list:
    """Start each tracker the recipe names; one that cannot start stops the others and raises."""
    backends: list = []
    try:
        for tracker in names:
            if tracker == "tensorboard":
                backends.append(_TensorBoard(run_dir, purge_step))
            else:
                backends.append(_WandB(run_dir, name or run_dir.name, config, group))
    except Exception as err:
        for backend in backends:
            with suppress(Exception):  # already failing: the start error is the one to report
                backend.close()
        problem = (
            tracker_problem(tracker) or f"{type(err).__name__}: {err}{START_HINTS.get(tracker, '')}"
        )
        raise RecipeError(f"logging: {tracker!r} could not start: {problem}") from err
    return backends


class Trackers:
    """What a run sends each step: its metrics line and a few decoded samples, to samples.jsonl
    and to every tracker of the recipe. Never raises into the training loop."""

    def __init__(
        self, run_dir: Path, tokenizer, backends: list, warn: Callable[[str], None]
    ) -> None:
        self.tokenizer, self.backends, self.warn = tokenizer, backends, warn
        self.samples = JsonlWriter(run_dir / "samples.jsonl")
        self._warned: set[str] = set()

    def log_step(self, line: str, samples: list[Sample]) -> None:
        row = json.loads(line)
        step = row["step"]
        rows = self._guard("samples.jsonl", self._write_samples, step, samples) or []
        values = scalars(row)
        for backend in self.backends:
            self._guard(backend.name, backend.log, step, values, rows)

    def _write_samples(self, step: int, samples: list[Sample]) -> list[dict]:
        rows = [sample_row(step, s, self.tokenizer) for s in pick(samples)]
        for r in rows:
            self.samples.write(json.dumps(r, default=str))
        return rows

    def _guard(self, what: str, fn: Callable, *args):
        try:
            return fn(*args)
        except Exception as err:  # noqa: BLE001 - a view of the run must not stop it
            if what not in self._warned:
                self._warned.add(what)
                self.warn(
                    f"{what}: {type(err).__name__}: {err} (training goes on; metrics.jsonl has "
                    "every step; further errors of this tracker are not reported)"
                )
            return None

    def close(self) -> None:
        """Flush and close everything. Idempotent: a stopped run closes early, and again at the
        end."""
        backends, self.backends = self.backends, []
        for backend in backends:
            self._guard(backend.name, backend.close)
        self.samples.close()


def open_trackers(
    recipe: Recipe,
    run_dir: Path,
    tokenizer,
    warn: Callable[[str], None],
    resume_step: int | None = None,
    group: str | None = None,
) -> Trackers:
    """The run's trackers. `tokenizer` decodes the samples (the recipe model's when None);
    `resume_step`: the first step a resumed run will log; `group`: the sweep it is a run of (W&B
    groups it; TensorBoard shows a sweep's runs together from `--logdir SWEEP_DIR`)."""
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(recipe.model)
    backends = open_backends(
        recipe.logging, run_dir, recipe.model_dump(mode="json"), purge_step=resume_step, group=group
    )
    return Trackers(run_dir, tokenizer, backends, warn)


def log_images(
    recipe: Recipe, run_dir: Path, images: dict[str, Path], name: str | None = None
) -> None:
    """The bench's figures (panels.png) to the recipe's trackers, as a run of their own in run_dir.
    Nothing when the recipe logs nowhere; a figure that cannot be sent only warns."""
    if not recipe.logging:
        return
    # a bench re-run replaces its figures, as it does its runs
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    backends = open_backends(recipe.logging, run_dir, recipe.model_dump(mode="json"), name=name)
    try:
        for tag, path in images.items():
            for backend in backends:
                try:
                    backend.image(tag, path, 0)
                except Exception as err:  # noqa: BLE001 - the figure is on disk anyway
                    _print_warning(
                        f"{backend.name}: could not log {path}: {type(err).__name__}: {err}"
                    )
    finally:
        for backend in backends:
            with suppress(Exception):  # the figures are on disk anyway
                backend.close()


def _print_warning(message: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(f"[bold yellow]WARNING[/] {message}", highlight=False)
