"""`orbit bench`: the five modes on one workload, seed and model, summarised side by side.

Writes DIR/summary.json (median and p90 per metric and mode, ratios between panels),
DIR/panels.png (five Gantt panels on one time axis) and prints a table in the seed's style.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean, median

from rich.console import Console
from rich.table import Table

from orbit.config import Recipe, RecipeError
from orbit.modes import MODE_NAMES

TIMED = ("update_weights_s", "train_wait_s", "rollout_tok_per_dev_s", "useful_tok_per_dev_s", "step_s",
         "engine_paused_s")
# The panel figures of docs/design.md §6: (metric, label, lower is better)
HEADLINE = (
    ("update_weights_s", "update_weights", True),
    ("train_wait_s", "train wait", True),
    ("rollout_tok_per_dev_s", "throughput", False),
    ("step_s", "step", True),
)
# The targets for the canonical workload: (name, numerator, denominator, metric, bound)
TARGETS = (
    ("step_s db/sync <= 0.29", "double-buffer", "sync", "step_s", ("<=", 0.29)),
    ("train_wait_s db/async-adapter <= 0.19", "double-buffer", "async-adapter", "train_wait_s", ("<=", 0.19)),
    ("tok/s db/async-adapter >= 1.5", "double-buffer", "async-adapter", "rollout_tok_per_dev_s", (">=", 1.5)),
    ("update_weights_s db/async-adapter < 1", "double-buffer", "async-adapter", "update_weights_s", ("<", 1.0)),
)


@dataclass
class BenchResult:
    out: Path
    summary: dict


def p90(values: list[float]) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(0.9 * (len(s) - 1)))]


def summarize(rows: list[dict]) -> dict:
    """One mode's measured steps → medians, p90s and staleness/reward figures."""
    out: dict = {"steps": len(rows)}
    for key in TIMED:
        values = [r[key] for r in rows]
        out[key] = {"median": median(values), "p90": p90(values)}
    out["staleness_mean"] = fmean(r["staleness_mean"] for r in rows)
    out["staleness_max"] = max(r["staleness_max"] for r in rows)
    out["stale_dropped"] = sum(r["stale_dropped"] for r in rows)
    generated = sum(r["tokens_generated"] for r in rows)
    out["waste_frac"] = sum(r["waste_frac"] * r["tokens_generated"] for r in rows) / generated if generated else 0.0
    out["reward_mean"] = fmean(r["reward_mean"] for r in rows)
    diffs = [r["logprob_diff"] for r in rows if r.get("logprob_diff") is not None]
    out["logprob_diff_max"] = max(diffs) if diffs else None
    return out


def ratios(per_mode: dict) -> dict:
    """Each panel relative to the previous panel and to sync, on the headline medians."""
    out: dict = {}
    for i, mode in enumerate(MODE_NAMES):
        prev = MODE_NAMES[i - 1] if i else None
        out[mode] = {}
        for key, _, _ in HEADLINE:
            cur = per_mode[mode][key]["median"]
            out[mode][key] = {
                "vs_prev": _ratio(cur, per_mode[prev][key]["median"]) if prev else None,
                "vs_sync": _ratio(cur, per_mode["sync"][key]["median"]),
            }
    return out


def targets(per_mode: dict) -> list[dict]:
    rows = []
    for name, num, den, key, (op, bound) in TARGETS:
        r = _ratio(per_mode[num][key]["median"], per_mode[den][key]["median"])
        ok = r is not None and {"<=": r <= bound, ">=": r >= bound, "<": r < bound}[op]
        rows.append({"target": name, "ratio": r, "met": ok})
    return rows


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def _pct(r: float | None) -> str:
    if r is None:
        return "-"
    pct = (r - 1.0) * 100
    return f"{'+' if pct >= 0 else '−'}{abs(pct):.1f}%"


def table(summary: dict) -> Table:
    """Metrics as rows, modes as columns; each headline cell: median, Δ vs previous panel, Δ vs sync."""
    t = Table(title="orbit bench — medians over measured steps\n(Δ prev = vs the panel to the left, Δ sync = vs sync)",
              header_style="bold cyan")
    t.add_column("metric")
    for mode in MODE_NAMES:
        t.add_column(mode, justify="right")
    modes, rat = summary["modes"], summary["ratios"]
    for key, label, _ in HEADLINE:
        cells = []
        for mode in MODE_NAMES:
            value = modes[mode][key]["median"]
            shown = f"{value:.1f} tok/s" if key == "rollout_tok_per_dev_s" else f"{value:.3f} s"
            if mode == "sync":
                cells.append(shown)
            else:
                r = rat[mode][key]
                cells.append(f"{shown}\n{_pct(r['vs_prev'])} prev\n{_pct(r['vs_sync'])} sync")
        t.add_row(label, *cells, end_section=True)
    t.add_row("staleness mean/max", *[f"{modes[m]['staleness_mean']:.2f}/{modes[m]['staleness_max']}"
                                      for m in MODE_NAMES])
    t.add_row("stale dropped", *[str(modes[m]["stale_dropped"]) for m in MODE_NAMES])
    t.add_row("useful tok/s", *[f"{modes[m]['useful_tok_per_dev_s']['median']:.1f}" for m in MODE_NAMES])
    t.add_row("waste", *[f"{modes[m]['waste_frac']:.1%}" for m in MODE_NAMES])
    t.add_row("reward mean", *[f"{modes[m]['reward_mean']:.3f}" for m in MODE_NAMES])
    return t


def run_bench(
    recipe: Recipe, out: Path, steps: int, warmup: int, console: Console | None = None, live: bool = False
) -> BenchResult:
    """Run the five modes one after another and write summary.json and panels.png into `out`."""
    from orbit.panels import draw_panels
    from orbit.run import train

    if steps < 1:
        raise RecipeError(f"--steps: must be >= 1 measured step, got {steps}")
    if warmup < 0:
        raise RecipeError(f"--warmup: must be >= 0, got {warmup}")
    console = console or Console()
    out.mkdir(parents=True, exist_ok=True)
    per_mode, windows = {}, {}
    for mode in MODE_NAMES:
        run_dir = out / mode
        shutil.rmtree(run_dir, ignore_errors=True)  # a bench re-run measures afresh
        r = recipe.model_copy(deep=True, update={"mode": mode, "out": run_dir})
        r.trainer.steps = warmup + steps
        r.trainer.save_every = warmup + steps  # one checkpoint at the end, not inside the timed steps
        console.print(f"[bold]bench[/] {mode}: {warmup} warm-up + {steps} measured steps")
        train(r, live=live, console=console)
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        measured = rows[warmup:]
        per_mode[mode] = summarize(measured)
        windows[mode] = _window(run_dir, measured)
    summary = {
        "recipe": recipe.model_dump(mode="json"),
        "steps": steps,
        "warmup": warmup,
        "modes": per_mode,
        "ratios": ratios(per_mode),
        "targets": targets(per_mode),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    draw_panels(out, windows, out / "panels.png")
    console.print(table(summary))
    for t in summary["targets"]:
        mark = "[green]met[/]" if t["met"] else "[red]missed[/]"
        ratio = "-" if t["ratio"] is None else f"{t['ratio']:.3f}"
        console.print(f"  target {t['target']}: ratio {ratio} {mark}")
    return BenchResult(out, summary)


def _window(run_dir: Path, measured: list[dict]) -> tuple[float, float]:
    """The wall-clock span of the measured steps, from the timeline's trainer events."""
    events = [json.loads(x) for x in (run_dir / "timeline.jsonl").read_text().splitlines()]
    trainer = [e for e in events if e["actor"] == "trainer"]
    first = measured[0]["step"]
    starts = [e["t0"] for e in trainer if e["kind"] == "wait" and e["version"] == first]
    end = max(e["t1"] for e in trainer)
    return (min(starts) if starts else min(e["t0"] for e in trainer), end)
