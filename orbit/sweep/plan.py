"""A sweep's plan: the K runs of one recipe (`--vary KEY=V1,V2 ...` or the recipe's `runs:`), each a
whole recipe of its own, checked before anything starts.

The runs share the base model, the engines and the trainer's device, so whatever sets those
(`SHARED`) is the sweep's and cannot differ between runs; anything else (trainer, rollout, task,
adapter settings, the seed) may. Each run keeps the ring of `engine.slots` slots a single run has,
so the engines hold K × `engine.slots` slots (SGLang: `max_loras_per_batch` K × slots + 1, the base
included), none evicted while the sweep runs.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from orbit.config import Recipe, RecipeError, dump_recipe, parse_recipe, set_dotted
from orbit.run.preflight import preflight

# What the runs of a sweep share: the base model, the engines, the loop, the trainer's device and
# whether their steps are packed.
SHARED = (
    "model",
    "engine",
    "mode",
    "logging",
    "trainer.device",
    "trainer.devices",
    "trainer.dtype",
    "trainer.threads",
    "trainer.shard",
    "trainer.pack",
)
# adapters one engine holds at once (each a few MB at most: tensors, not models)
MAX_ENGINE_SLOTS = 64
SWEEP_FILE = "sweep.yaml"


@dataclass
class PlannedRun:
    # what the console, the table and W&B call it: `lr=0.0003,seed=1` or the entry's `name`
    name: str
    recipe: Recipe  # a whole recipe; its `out` is the run's own directory inside the sweep's

    @property
    def run_dir(self) -> Path:
        return self.recipe.out


@dataclass
class SweepPlan:
    recipe: Recipe  # the shared recipe: the model, the engines, the sweep's directory (`out`)
    runs: list[PlannedRun]

    @property
    def out(self) -> Path:
        return self.recipe.out


def is_sweep(path: Path) -> bool:
    """Whether a recipe file lists the runs of a sweep (`runs:`)."""
    try:
        data = yaml.safe_load(path.read_text()) if path.is_file() else None
    except yaml.YAMLError:
        return False  # loading it as a recipe says what is wrong
    return isinstance(data, dict) and bool(data.get("runs"))


def parse_vary(texts: list[str]) -> list[dict[str, Any]]:
    """`["trainer.lr=1e-4,3e-4", "seed=0,1"]` → every combination, as dotted overrides."""
    axes = []
    for text in texts:
        key, eq, values = text.partition("=")
        if not eq or not key.strip() or not values.strip():
            raise RecipeError(
                f"--vary {text!r}: write KEY=V1,V2,... (e.g. --vary trainer.lr=1e-4,3e-4)"
            )
        axes.append([(key.strip(), yaml.safe_load(v)) for v in values.split(",")])
    return [dict(combo) for combo in itertools.product(*axes)]


def plan_sweep(path: Path, vary: list[str], overrides: dict[str, Any] | None = None) -> SweepPlan:
    """The sweep a recipe file and `--vary` options describe, with the command line's dotted
    `overrides` of the shared recipe (RecipeError naming the run and the field)."""
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {str(path)!r}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe is a mapping of sections")
    entries = data.pop("runs", None) or []
    if vary and entries:
        raise RecipeError(f"{path} lists its runs (runs:); leave out --vary, or the runs: list")
    if vary:
        entries = parse_vary(vary)
    if len(entries) < 2:
        raise RecipeError(
            "a sweep needs at least 2 runs: pass --vary KEY=V1,V2 or list them under runs: in "
            f"{path}"
        )
    for key, value in (overrides or {}).items():
        if value is not None:
            set_dotted(data, key, value)
    recipe = parse_recipe(data)
    runs = [_planned(data, recipe, entry, i) for i, entry in enumerate(entries)]
    _check(recipe, runs)
    return SweepPlan(recipe, runs)


def _planned(data: dict, shared: Recipe, entry: Any, i: int) -> PlannedRun:
    if not isinstance(entry, dict):
        raise RecipeError(
            f"runs[{i}]: each run is a mapping of settings (e.g. {{trainer.lr: 1e-4}}), got "
            f"{entry!r}"
        )
    overrides = _dotted(entry)
    name = str(
        overrides.pop("name", "")
        or ",".join(f"{k.rpartition('.')[2]}={v}" for k, v in overrides.items())
    )
    where = f"runs[{i}] ({name})"
    for key in overrides:
        if any(key == s or key.startswith(s + ".") for s in SHARED + ("out",)):
            raise RecipeError(
                f"{where}: {key}: the runs of a sweep share the base model, the engines and the "
                f"trainer's device, so {key} cannot vary; vary trainer, rollout, task, adapter or "
                "seed settings"
            )
    run = yaml.safe_load(yaml.safe_dump(data))  # a deep copy of plain data
    run["out"] = str(shared.out / _dir_name(name))
    try:
        for key, value in overrides.items():
            set_dotted(run, key, value)
        return PlannedRun(name, parse_recipe(run))
    except RecipeError as err:
        raise RecipeError(f"{where}: {err}") from None


def _dotted(entry: dict, prefix: str = "") -> dict[str, Any]:
    """{trainer: {lr: 1}} and {trainer.lr: 1} alike → {"trainer.lr": 1}."""
    out: dict[str, Any] = {}
    for key, value in entry.items():
        if isinstance(value, dict):
            out.update(_dotted(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _dir_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=+-]", "_", name)[:100] or "run"


def preflight_sweep(plan: SweepPlan) -> tuple[SweepPlan, tuple[str, ...]]:
    """orbit/run/preflight.py's checks of the shared recipe and of each run (its task, its adapter
    on this model), every run given the shared recipe's resolved engines; with the notes to
    print."""
    checked = preflight(plan.recipe)
    runs = []
    for run in plan.runs:
        recipe = run.recipe.model_copy(update={"engine": checked.recipe.engine})
        try:
            runs.append(PlannedRun(run.name, preflight(recipe).recipe))
        except RecipeError as err:
            raise RecipeError(f"{run.name}: {err}") from None
    if plan.recipe.adapter.type == "oft" and checked.recipe.engine.backend in (
        "sglang",
        "sglang-server",
    ):
        raise RecipeError(
            "adapter.type: oft reaches SGLang as merged weights, which would change the base every "
            "run of the sweep shares; sweep OFT on the embedded engine, or LoRA on SGLang"
        )
    return SweepPlan(checked.recipe, runs), checked.notes


def _check(recipe: Recipe, runs: list[PlannedRun]) -> None:
    """What a sweep needs of every run, before anything starts."""
    if recipe.mode != "double-buffer":
        raise RecipeError(
            "mode: a sweep trains each adapter double-buffered (its own slots, flipped on its "
            f"own); got {recipe.mode!r}: set mode: double-buffer"
        )
    if len(recipe.trainer.rank_devices()) > 1:
        raise RecipeError(
            "trainer.devices: a sweep's adapters share one trainer device; give it one device "
            "(trainer ranks train one adapter across devices: orbit train)"
        )
    dirs = [r.run_dir for r in runs]
    if len(set(dirs)) != len(dirs):
        twice = next(d for d in dirs if dirs.count(d) > 1)
        raise RecipeError(
            f"runs: two runs would share the directory {twice}; give them distinct names (name:)"
        )
    kinds = {r.recipe.adapter.type for r in runs}
    if len(kinds) > 1:
        raise RecipeError(f"adapter.type: a sweep's adapters are of one kind (got {sorted(kinds)})")
    total = len(runs) * recipe.engine.slots
    if total > MAX_ENGINE_SLOTS:
        raise RecipeError(
            f"engine.slots: {len(runs)} runs × {recipe.engine.slots} slots each = {total} adapter "
            f"slots per engine, more than {MAX_ENGINE_SLOTS}; sweep fewer runs at once or lower "
            "engine.slots"
        )


def dump_sweep(plan: SweepPlan) -> str:
    """sweep.yaml: the shared recipe and each run's name and directory."""
    return dump_recipe(plan.recipe) + yaml.safe_dump(
        {"runs": [{"name": r.name, "out": str(r.run_dir)} for r in plan.runs]}, sort_keys=False
    )
