"""The engine pool's flips side by side: one mode on N engines, once per flip (barrier against
independent), the last engine made slower (bench/straggler.py), drawn on one clock.

    .venv/bin/python bench/pool.py bench/five-panel.yaml --replicas 2 --slow-running 8 --slow-load
    0.3 \
        --steps 8 --warmup 1 --out runs/bench-pool

Writes OUT/summary.json (`flips.<flip>.<metric>`: median and p90, `independent_vs_barrier` ratios),
OUT/panels.png and OUT/panels.html, and prints the table. `make bench` runs the line above.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table
from straggler import Slowing, slowed

from orbit.config import RecipeError, load_recipe
from orbit.config.modes import MODE_NAMES
from orbit.measure.bench import (
    BenchResult,
    check_args,
    figure,
    headline,
    ratio,
    run_mode,
    secs,
    summarize,
)
from orbit.metrics.gantt import draw_panels
from orbit.pages.panels import write_panels_html
from orbit.push.fleet import FLIPS
from orbit.run.preflight import Checked, preflight
from orbit.run.trackers import log_images

# independent / barrier on these (medians; mean rates)
POOL_RATIOS = ("step_s", "rollout_tok_per_dev_s", "trainer_idle_s", "flip_lag_s")


def run_pool_bench(
    checked: Checked,
    out: Path,
    steps: int,
    warmup: int,
    replicas: int = 2,
    flips: tuple[str, ...] = FLIPS,
    slowing: Slowing = Slowing(),
    console: Console | None = None,
    live: bool = False,
) -> BenchResult:
    """The recipe's mode on `replicas` engines, once per flip in `flips`, the last engine slowed as
    `slowing` says. Writes OUT/summary.json, OUT/panels.png and OUT/panels.html."""
    check_args(steps, warmup)
    if replicas < 2:
        raise RecipeError(f"--replicas: the pool bench needs at least 2 engines, got {replicas}")
    if bad := [f for f in flips if f not in FLIPS]:
        raise RecipeError(f"--flip: {bad[0]!r} is not a flip (allowed: {', '.join(FLIPS)})")
    console = console or Console()
    recipe = checked.recipe
    for note in checked.notes:
        console.print(note, highlight=False)
    out.mkdir(parents=True, exist_ok=True)
    per_flip, windows = {}, {}
    for flip in flips:
        r = recipe.model_copy(deep=True)
        r.engine.replicas, r.engine.flip, r.engine.devices = replicas, flip, None
        label = f"{replicas} engines, {flip} flip"
        rows, windows[flip] = run_mode(
            r,
            r.mode,
            out / flip,
            steps,
            warmup,
            console,
            live,
            label=label,
            engines=slowed(slowing),
        )
        per_flip[flip] = summarize(rows, replicas)
    summary = {
        "recipe": recipe.model_dump(mode="json"),
        "mode": recipe.mode,
        "replicas": replicas,
        "slow_engine": {"index": replicas - 1, **dataclasses.asdict(slowing)},
        "steps": steps,
        "warmup": warmup,
        "flips": per_flip,
    }
    if {"barrier", "independent"} <= set(per_flip):
        summary["independent_vs_barrier"] = {
            k: ratio(figure(per_flip, "independent", k), figure(per_flip, "barrier", k))
            for k in POOL_RATIOS
        }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    titles = {f: f"{recipe.mode}, {replicas} engines, {f} flip" for f in per_flip}
    title = f"{recipe.engine.backend}: {replicas} engines, engine {replicas - 1} slowed"
    modes = {f: recipe.mode for f in per_flip}
    draw_panels(out, windows, out / "panels.png", titles=titles, modes=modes, title=title)
    headlines = {f: headline(per_flip[f]) for f in per_flip}
    write_panels_html(
        out, windows, out / "panels.html", headlines=headlines, titles=titles, title=title
    )
    log_images(recipe, out / "tracking", {"panels": out / "panels.png"}, name=out.name)
    console.print(pool_table(summary))
    return BenchResult(out, summary)


def pool_table(summary: dict) -> Table:
    flips = list(summary["flips"])
    slow = summary["slow_engine"]["index"]
    t = Table(
        title=f"pool bench — {summary['mode']} on {summary['replicas']} engines (engine {slow} "
        "slowed) — medians",
        header_style="bold cyan",
    )
    t.add_column("metric")
    for flip in flips:
        t.add_column(f"{flip} flip", justify="right")
    if "independent_vs_barrier" in summary:
        t.add_column("independent / barrier", justify="right")
    for key in POOL_RATIOS + ("update_weights_s", "engine_paused_s"):
        cells = [
            f"{summary['flips'][f][key]['mean']:.1f} tok/s"
            if key == "rollout_tok_per_dev_s"
            else secs(summary["flips"][f][key])
            for f in flips
        ]
        if "independent_vs_barrier" in summary:
            r = summary["independent_vs_barrier"].get(key)
            cells.append("-" if r is None else f"{r:.2f}×")
        t.add_row(key, *cells)
    return t


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("recipe", nargs="?", default="bench/five-panel.yaml")
    parser.add_argument("--replicas", type=int, default=2, help="engines in the pool (2 or more)")
    parser.add_argument("--mode", default="double-buffer", choices=MODE_NAMES)
    parser.add_argument("--flip", action="append", help="a flip to run (repeat; default: both)")
    parser.add_argument(
        "--slow-running", type=int, default=None, help="the last engine's max_running"
    )
    parser.add_argument("--slow-load", type=float, default=0.0, help="seconds added to its loads")
    parser.add_argument("--steps", type=int, default=8, help="measured steps per flip")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps per flip")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-pool"))
    args = parser.parse_args()
    console = Console()
    try:
        checked = preflight(load_recipe(Path(args.recipe), {"mode": args.mode}))
        slowing = Slowing(args.slow_running, args.slow_load)
        flips = tuple(args.flip or ("barrier", "independent"))
        result = run_pool_bench(
            checked, args.out, args.steps, args.warmup, args.replicas, flips, slowing, console
        )
    except RecipeError as err:
        Console(stderr=True).print(f"[bold red]error:[/] {err}", highlight=False)
        sys.exit(2)
    console.print(f"wrote {result.out / 'summary.json'} and {result.out / 'panels.png'}")


if __name__ == "__main__":
    main()
