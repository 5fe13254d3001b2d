"""The double-buffer push's tail against the number of slots, side by side in one run.

On SGLang a slot is an adapter name; rewriting it unloads the old adapter, which waits for every
request still using it. With two slots the inactive slot often still serves requests from two
versions back, so some pushes wait for them (a long tail); with a ring of `slots >= max_staleness
+ 2` the load goes to a slot nobody uses any more. For each slot count this runs double-buffer on
the same recipe and prints the median and p90 of each engine's update (load to flip, from the
timeline's `update` events) and of the trainer's blocking push (`update_weights_s`).

    .venv/bin/python bench/investigations/slot_ring.py          # five-panel workload, SGLang
    .venv/bin/python bench/investigations/slot_ring.py bench/five-panel.yaml --engine embedded \
        --slots 2 4
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from statistics import median

from rich.console import Console
from rich.table import Table

from orbit.config import load_recipe
from orbit.measure.bench import p90
from orbit.run.lifecycle import train
from orbit.run.preflight import preflight


def measure(
    recipe_path: Path, engine: str, slots: int, flip: str, steps: int, warmup: int, out: Path
) -> dict:
    run_dir = out / f"{engine}-s{slots}-{flip}"
    shutil.rmtree(run_dir, ignore_errors=True)
    recipe = load_recipe(
        recipe_path,
        {
            "mode": "double-buffer",
            "engine.backend": engine,
            "engine.slots": slots,
            "engine.flip": flip,
            "out": str(run_dir),
            "trainer.steps": warmup + steps,
            "trainer.save_every": 10_000,
        },
    )
    train(preflight(recipe), live=False)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][warmup:]
    events = [json.loads(x) for x in (run_dir / "timeline.jsonl").read_text().splitlines()]
    first = rows[0]["version"]
    updates = [e["t1"] - e["t0"] for e in events if e["kind"] == "update" and e["version"] >= first]
    pushes = [r["update_weights_s"] for r in rows]
    return {
        "update_median": median(updates),
        "update_p90": p90(updates),
        "push_median": median(pushes),
        "push_p90": p90(pushes),
        "step_median": median(r["step_s"] for r in rows),
        "updates": len(updates),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("recipe", nargs="?", default="bench/five-panel.yaml")
    parser.add_argument("--engine", default="sglang", choices=["sglang", "embedded"])
    parser.add_argument("--slots", type=int, nargs="*", default=[2, 3])
    parser.add_argument(
        "--flip",
        default="barrier",
        choices=["barrier", "independent"],
        help="barrier: the trainer waits for the update, so update_weights_s is its length too",
    )
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()

    out = Path(tempfile.mkdtemp(prefix="orbit-ring-"))
    table = Table(
        title=f"double-buffer on {args.recipe}, {args.engine}, flip {args.flip}: "
        f"{args.steps} steps after {args.warmup} warm-up"
    )
    for col in (
        "slots",
        "engine update median",
        "p90",
        "p90 / median",
        "trainer push median",
        "p90",
        "step",
    ):
        table.add_column(col, justify="right")
    for slots in args.slots:
        f = measure(Path(args.recipe), args.engine, slots, args.flip, args.steps, args.warmup, out)
        table.add_row(
            str(slots),
            f"{f['update_median']:.3f} s",
            f"{f['update_p90']:.3f} s",
            f"{f['update_p90'] / f['update_median']:.2f}",
            f"{f['push_median']:.3f} s",
            f"{f['push_p90']:.3f} s",
            f"{f['step_median']:.3f} s",
        )
    Console(width=160).print(table)
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
