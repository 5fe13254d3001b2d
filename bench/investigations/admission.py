"""Admission side by side: the former run-ahead rule against version-gated admission, one run.

For each case (mode, max_staleness) the same recipe, seed and model run twice: with Orbit's
admission (version: a group starts only when it will be trained within max_staleness versions), and
with the former run-ahead rule, which lives here (`RunAhead`, `run_ahead()`), not in Orbit; printed
per case: groups trained and dropped, the dropped share of all generated groups, staleness max, the
waste (tokens of dropped or aborted samples / tokens generated) and useful tokens per second (tokens
trained on / wall time).

    .venv/bin/python bench/investigations/admission.py       # recipes/tiny.yaml: the issue's cases
    .venv/bin/python bench/investigations/admission.py bench/five-panel.yaml \
        --cases double-buffer:2 --steps 10
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from statistics import median
from unittest import mock

from rich.console import Console
from rich.table import Table

import orbit.rollout.pipeline
from orbit.config import load_recipe
from orbit.engine.pool import EnginePool
from orbit.rollout.pipeline import Admission
from orbit.run.lifecycle import train
from orbit.run.preflight import preflight

DEFAULT_CASES = ("double-buffer:1", "double-buffer:0", "async-adapter:2", "async-full:2")


class RunAhead(Admission):
    """The former rule: at most (K + 1) batches in flight or buffered, on an engine of any version.
    It starts groups while the engine is a version behind, so some go stale and are dropped: the
    tests use it to make that happen."""

    def pick(self, pool: EnginePool, started: int, in_pipeline: int) -> int | None:
        return pool.pick(None) if in_pipeline < (self.k + 1) * self.batch else None


@contextmanager
def run_ahead() -> Iterator[None]:
    """Runs started inside the block admit groups by the former rule."""
    with mock.patch.object(orbit.rollout.pipeline, "Admission", RunAhead):
        yield


def measure(
    recipe_path: Path, mode: str, k: int, admission: str, steps: int | None, seed: int, out: Path
) -> dict:
    run_dir = out / f"{mode}-k{k}-{admission}-s{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = {
        "mode": mode,
        "max_staleness": k,
        "out": str(run_dir),
        "seed": seed,
        "trainer.steps": steps,
        "trainer.save_every": 10_000,
    }
    recipe = load_recipe(recipe_path, overrides)
    with run_ahead() if admission == "run-ahead" else nullcontext():
        result = train(preflight(recipe), live=False)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = len(rows) * recipe.rollout.prompts_per_step
    dropped = sum(r["stale_dropped"] for r in rows)
    generated = sum(r["tokens_generated"] for r in rows)
    wasted = sum(r["waste_frac"] * r["tokens_generated"] for r in rows)
    return {
        "trained": trained,
        "dropped": dropped,
        "drop_share": dropped / (trained + dropped),
        "staleness_max": max(r["staleness_max"] for r in rows),
        "staleness_bound_held": all(r["staleness_max"] <= k for r in rows),
        "waste_frac": wasted / generated if generated else 0.0,
        # per step, past the pipeline's first two steps (engine warm-up, the first batches' fill)
        "useful_tok_s": median(r["useful_tok_per_dev_s"] for r in rows[2:]),
        "reward_first_quarter": _mean([r["reward_mean"] for r in rows[: len(rows) // 4]]),
        "reward_last_quarter": _mean([r["reward_mean"] for r in rows[-(len(rows) // 4) :]]),
        "seconds": result.seconds,
    }


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("recipe", nargs="?", default="recipes/tiny.yaml")
    parser.add_argument(
        "--cases", nargs="*", default=list(DEFAULT_CASES), help="mode:max_staleness ..."
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="train steps (default: the recipe's)"
    )
    parser.add_argument("--seeds", type=int, nargs="*", default=[0])
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()

    console = Console(width=170)
    out = Path(tempfile.mkdtemp(prefix="orbit-admission-"))
    table = Table(
        title=f"admission on {args.recipe}: run-ahead (former) vs version (now), seeds {args.seeds}"
    )
    for col in (
        "mode",
        "K",
        "admission",
        "trained",
        "dropped",
        "dropped share",
        "staleness max",
        "waste",
        "useful tok/s",
        "reward 1st→last quarter",
    ):
        table.add_column(col, justify="right")
    figures = []
    for case in args.cases:
        mode, k = case.split(":")
        for seed in args.seeds:
            for admission in ("run-ahead", "version"):
                console.print(f"{mode} K={k} {admission} seed {seed} ...")
                f = measure(Path(args.recipe), mode, int(k), admission, args.steps, seed, out)
                figures.append(
                    {
                        "mode": mode,
                        "max_staleness": int(k),
                        "admission": admission,
                        "seed": seed,
                        **f,
                    }
                )
                table.add_row(
                    mode,
                    k,
                    admission,
                    str(f["trained"]),
                    str(f["dropped"]),
                    f"{f['drop_share']:.1%}",
                    f"{f['staleness_max']}"
                    + ("" if f["staleness_bound_held"] else " (bound broken!)"),
                    f"{f['waste_frac']:.1%}",
                    f"{f['useful_tok_s']:.0f}",
                    f"{f['reward_first_quarter']:.2f} → {f['reward_last_quarter']:.2f}",
                )
    console.print(table)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    sys.exit(0 if all(f["staleness_bound_held"] for f in figures) else 1)


if __name__ == "__main__":
    main()
