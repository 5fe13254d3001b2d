"""`orbit bench`: the five modes on one workload, seed and model, summarised side by side.

For each engine backend it is given, the bench runs the five modes and sets each step against its
floor, the fastest it could have been at the speed the run's own engines generated (`floor_s`).
Writes DIR/summary.json (`engines.<backend>.modes.<mode>.<metric>`: median and p90 per metric,
busy shares, ratios between panels, targets met or missed), DIR/<backend>/panels.png (five Gantt
panels on one time axis, each with its floor) and prints a table per engine in the seed's style.
The engine pool's flips (barrier against independent, with a straggler) are a bench script of their
own: bench/pool.py.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean, median
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from orbit.config import Recipe, RecipeError
from orbit.config.modes import MODE_NAMES, MODES
from orbit.measure.flops import flop_floor_s, matmul_params, matmul_peak
from orbit.run.preflight import Checked, preflight
from orbit.run.trackers import log_images

if TYPE_CHECKING:
    from orbit.run.engines import EnginesFor

TIMED = (
    "step_s",
    "trainer_idle_s",
    "train_s",
    "update_weights_s",
    "train_wait_s",
    "rollout_tok_per_dev_s",
    "useful_tok_per_dev_s",
    "flip_lag_s",
    "engine_paused_s",
)
# The panel figures of docs/design.md §6: (metric, label, lower is better)
HEADLINE = (
    ("update_weights_s", "update_weights", True),
    ("trainer_idle_s", "trainer idle", True),
    ("rollout_tok_per_dev_s", "throughput", False),
    ("step_s", "step", True),
)
# Targets, per engine: (name, numerator mode, denominator mode or "floor", metric, bound). The
# seed's figures first (its "train wait" is trainer_idle_s: a blocking push stands in for a wait),
# then the bench issue's own.
TARGETS = (
    ("seed: step db/sync <= 0.29", "double-buffer", "sync", "step_s", ("<=", 0.29)),
    (
        "seed: trainer idle db/async-adapter <= 0.19",
        "double-buffer",
        "async-adapter",
        "trainer_idle_s",
        ("<=", 0.19),
    ),
    (
        "seed: tok/s db/async-adapter >= 1.5",
        "double-buffer",
        "async-adapter",
        "rollout_tok_per_dev_s",
        (">=", 1.5),
    ),
    (
        "seed: update_weights db/async-adapter < 1",
        "double-buffer",
        "async-adapter",
        "update_weights_s",
        ("<", 1.0),
    ),
    (
        "blocking push db/async-adapter <= 0.7",
        "double-buffer",
        "async-adapter",
        "update_weights_s",
        ("<=", 0.7),
    ),
    (
        "trainer idle db/async-adapter <= 0.25",
        "double-buffer",
        "async-adapter",
        "trainer_idle_s",
        ("<=", 0.25),
    ),
    ("step db/its floor <= 1.1", "double-buffer", "floor", "step_s", ("<=", 1.1)),
)
# Rates: tokens come in bursts (a step's count is what finished in it), so besides the per-step
# median and p90 their summary has the mean rate, Σ tokens / Σ step time, which the tables, ratios
# and targets use.
RATES = ("rollout_tok_per_dev_s", "useful_tok_per_dev_s")


@dataclass
class BenchResult:
    out: Path
    summary: dict


def p90(values: list[float]) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(0.9 * (len(s) - 1)))]


def engine_rate(rows: list[dict], engines: int) -> float:
    """Tokens per second of one engine while busy, over a run's steps: what its engines
    delivered."""
    busy = sum(r["engine_busy_s"] for r in rows) / engines
    return sum(r["tokens_generated"] for r in rows) / busy / engines if busy else float("inf")


def floor_s(rows: list[dict], serial: bool, engines: int) -> float:
    """The fastest a mode's steps could have been, per step, over its measured window: what its two
    workers did in the window, at the speeds they did it.

    Serial: the engines' busy time + train + push (nothing overlaps). Overlapped: the slower of the
    trainer's part (train + the push that holds it) and the engines' busy time (each engine
    generating what it generated, at its own measured pace). Both are parts of the window's wall
    time, so no window is faster than its floor: step/floor >= 1 for every mode. (Counting the
    batches' trained tokens at the engine's rate instead would not be a bound: a pipelined window
    trains tokens generated before it.)"""
    trainer = sum(r["train_s"] + r["update_weights_s"] for r in rows)
    busy = sum(r["engine_busy_s"] for r in rows) / engines
    return ((busy + trainer) if serial else max(trainer, busy)) / len(rows)


def summarize(rows: list[dict], engines: int = 1, floor: float | None = None) -> dict:
    """One mode's measured steps → medians, p90s, busy shares and staleness, reward and waste
    figures; with its `floor`, the mean step against it (`floor_ratio`)."""
    out: dict = {"steps": len(rows)}
    for key in TIMED:
        values = [r[key] for r in rows if r.get(key) is not None]
        out[key] = {"median": median(values), "p90": p90(values)} if values else None
    wall = sum(r["step_s"] for r in rows)
    for key in RATES:
        out[key]["mean"] = sum(r[key] * r["step_s"] for r in rows) / wall
    out["step_mean_s"] = wall / len(rows)
    out["floor_s"] = floor
    out["floor_ratio"] = out["step_mean_s"] / floor if floor else None
    out["engine_busy_frac"] = sum(r.get("engine_busy_s", 0.0) for r in rows) / wall / engines
    out["trainer_busy_frac"] = sum(r["train_s"] for r in rows) / wall
    out["staleness_mean"] = fmean(r["staleness_mean"] for r in rows)
    out["staleness_max"] = max(r["staleness_max"] for r in rows)
    out["stale_dropped"] = sum(r["stale_dropped"] for r in rows)
    generated = sum(r["tokens_generated"] for r in rows)
    out["waste_frac"] = (
        sum(r["waste_frac"] * r["tokens_generated"] for r in rows) / generated if generated else 0.0
    )
    out["reward_mean"] = fmean(r["reward_mean"] for r in rows)
    diffs = [r["logprob_diff"] for r in rows if r.get("logprob_diff") is not None]
    out["logprob_diff_max"] = max(diffs) if diffs else None
    return out


def headline(s: dict) -> str:
    """A panel's figures in one line: step, tok/s, train wait, push, and the floor where there is
    one."""
    parts = [
        f"step {s['step_s']['median']:.3f} s",
        f"{s['rollout_tok_per_dev_s']['mean']:,.0f} tok/s",
        f"train wait {s['train_wait_s']['median']:.3f} s",
        f"push {s['update_weights_s']['median']:.3f} s",
    ]
    if s.get("floor_s"):
        parts.append(f"floor {s['floor_s']:.3f} s (mean step/floor {s['floor_ratio']:.2f}×)")
    return " · ".join(parts)


def figure(per_mode: dict, mode: str, key: str) -> float | None:
    """The figure a comparison uses: the median, or for a rate its mean."""
    cell = per_mode[mode].get(key)
    return cell["mean" if key in RATES else "median"] if cell else None


def ratios(per_mode: dict) -> dict:
    """Each panel relative to the previous panel and to sync, on the headline medians."""
    out: dict = {}
    for i, mode in enumerate(MODE_NAMES):
        prev = MODE_NAMES[i - 1] if i else None
        out[mode] = {}
        for key, _, _ in HEADLINE:
            cur = figure(per_mode, mode, key)
            out[mode][key] = {
                "vs_prev": ratio(cur, figure(per_mode, prev, key)) if prev else None,
                "vs_sync": ratio(cur, figure(per_mode, "sync", key)),
            }
    return out


def targets(per_mode: dict) -> list[dict]:
    rows = []
    for name, num, den, key, (op, bound) in TARGETS:
        if den == "floor":  # the mean step against the floor, both over the measured window
            r = ratio(per_mode[num]["step_mean_s"], per_mode[num]["floor_s"])
        else:
            r = ratio(figure(per_mode, num, key), figure(per_mode, den, key))
        ok = r is not None and {"<=": r <= bound, ">=": r >= bound, "<": r < bound}[op]
        rows.append({"target": name, "ratio": r, "met": ok})
    return rows


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _pct(r: float | None) -> str:
    if r is None:
        return "-"
    pct = (r - 1.0) * 100
    return f"{'+' if pct >= 0 else '−'}{abs(pct):.1f}%"


def secs(cell: dict | None) -> str:
    return "-" if cell is None else f"{cell['median']:.3f} s"


def table(section: dict, engine: str) -> Table:
    """Metrics as rows, modes as columns; each headline cell: median, Δ vs previous panel, Δ vs
    sync."""
    t = Table(
        title=f"orbit bench — {engine} engine — medians over measured steps (rates: Σ tokens / Σ "
        "time)\n"
        "(Δ prev = vs the panel to the left, Δ sync = vs sync)",
        header_style="bold cyan",
    )
    t.add_column("metric")
    for mode in MODE_NAMES:
        t.add_column(mode, justify="right")
    modes, rat = section["modes"], section["ratios"]
    for key, label, _ in HEADLINE:
        cells = []
        for mode in MODE_NAMES:
            value = figure(modes, mode, key)
            shown = f"{value:.1f} tok/s" if key == "rollout_tok_per_dev_s" else f"{value:.3f} s"
            if mode == "sync":
                cells.append(shown)
            else:
                r = rat[mode][key]
                cells.append(f"{shown}\n{_pct(r['vs_prev'])} prev\n{_pct(r['vs_sync'])} sync")
        t.add_row(label, *cells, end_section=True)
    t.add_row(
        "floor (mean step/floor)",
        *[f"{modes[m]['floor_s']:.3f} s ({modes[m]['floor_ratio']:.2f}×)" for m in MODE_NAMES],
    )
    if modes[MODE_NAMES[0]].get("flop_floor_s"):
        t.add_row(
            "FLOP floor (mean step/it)",
            *[
                f"{modes[m]['flop_floor_s']:.3f} s ({modes[m]['flop_floor_ratio']:.1f}×)"
                for m in MODE_NAMES
            ],
        )
    t.add_row("train wait", *[secs(modes[m]["train_wait_s"]) for m in MODE_NAMES])
    t.add_row("train", *[secs(modes[m]["train_s"]) for m in MODE_NAMES])
    t.add_row("flip lag", *[secs(modes[m]["flip_lag_s"]) for m in MODE_NAMES])
    t.add_row(
        "engine / trainer busy",
        *[
            f"{modes[m]['engine_busy_frac']:.0%} / {modes[m]['trainer_busy_frac']:.0%}"
            for m in MODE_NAMES
        ],
    )
    t.add_row(
        "staleness mean/max",
        *[f"{modes[m]['staleness_mean']:.2f}/{modes[m]['staleness_max']}" for m in MODE_NAMES],
    )
    t.add_row("stale dropped", *[str(modes[m]["stale_dropped"]) for m in MODE_NAMES])
    t.add_row(
        "useful tok/s", *[f"{modes[m]['useful_tok_per_dev_s']['mean']:.1f}" for m in MODE_NAMES]
    )
    t.add_row("waste", *[f"{modes[m]['waste_frac']:.1%}" for m in MODE_NAMES])
    t.add_row("reward mean", *[f"{modes[m]['reward_mean']:.3f}" for m in MODE_NAMES])
    return t


def check_args(steps: int, warmup: int) -> None:
    if steps < 1:
        raise RecipeError(f"--steps: must be >= 1 measured step, got {steps}")
    if warmup < 0:
        raise RecipeError(f"--warmup: must be >= 0, got {warmup}")


def run_bench(
    checked: Checked,
    out: Path,
    steps: int,
    warmup: int,
    console: Console | None = None,
    live: bool = False,
    engines: list[str] | None = None,
) -> BenchResult:
    """The five modes on each engine backend in `engines` (default: the recipe's), one after the
    other. Writes OUT/summary.json (a section per engine) and OUT/<engine>/panels.png."""
    check_args(steps, warmup)
    console = console or Console()
    out.mkdir(parents=True, exist_ok=True)
    recipe = checked.recipe
    summary: dict = {
        "recipe": recipe.model_dump(mode="json"),
        "steps": steps,
        "warmup": warmup,
        "engines": {},
    }
    for note in checked.notes if not engines else ():
        console.print(note, highlight=False)
    for backend in engines or [recipe.engine.backend]:
        engine = recipe.engine.model_copy(update={"backend": backend})
        r = preflight(
            recipe.model_copy(deep=True, update={"engine": engine})
        ).recipe  # this backend's own checks (installed, model it runs)
        summary["engines"][backend] = section = _bench_engine(
            r, out / backend, steps, warmup, console, live
        )
        # each engine's part as soon as it is in
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        console.print(table(section, backend))
        _print_targets(console, section["targets"])
    log_images(
        recipe,
        out / "tracking",
        {f"panels/{b}": Path(s["panels"]) for b, s in summary["engines"].items()},
        name=out.name,
    )
    return BenchResult(out, summary)


def _bench_engine(
    recipe: Recipe, out: Path, steps: int, warmup: int, console: Console, live: bool
) -> dict:
    """The five modes on one engine backend: its summary section."""
    from orbit.metrics.gantt import draw_panels
    from orbit.pages.panels import write_panels_html

    per_mode, windows = {}, {}
    engines = recipe.engine.engines
    flops = _flop_scale(recipe, console)
    for mode in MODE_NAMES:
        rows, windows[mode] = run_mode(recipe, mode, out / mode, steps, warmup, console, live)
        per_mode[mode] = summarize(
            rows, engines, floor_s(rows, MODES[mode].loop == "serial", engines)
        )
        per_mode[mode]["engine_tok_per_busy_s"] = engine_rate(rows, engines)
        # each mode's line as it ends: a long bench (a GPU's engine starts) shows what it has
        console.print(f"{mode}: {headline(per_mode[mode])}", highlight=False)
        if flops:
            per_mode[mode]["flop_floor_s"] = floor = flop_floor_s(rows, *flops)
            per_mode[mode]["flop_floor_ratio"] = per_mode[mode]["step_mean_s"] / floor
    floors = {m: per_mode[m]["floor_s"] for m in MODE_NAMES}
    draw_panels(
        out, windows, out / "panels.png", floors=floors, title=f"{recipe.engine.backend} engine"
    )
    write_panels_html(
        out,
        windows,
        out / "panels.html",
        floors=floors,
        headlines={m: headline(per_mode[m]) for m in MODE_NAMES},
        titles={m: f"{m} ({MODES[m].loop} loop, {MODES[m].push} push)" for m in MODE_NAMES},
        title=f"orbit bench: the five modes on the {recipe.engine.backend} engine",
    )
    return {
        "modes": per_mode,
        "ratios": ratios(per_mode),
        "targets": targets(per_mode),
        "panels": str(out / "panels.png"),
        "matmul_params": flops[0] if flops else None,
        "peak_gflops": flops[1] if flops else None,
    }


def _flop_scale(recipe: Recipe, console: Console) -> tuple[int, float] | None:
    """The model's matmul weights and this machine's float32 matmul peak on the cores the run uses
    (trainer and engine threads), for each mode's FLOP floor; on a CPU run only (a GPU's peak is
    its own)."""
    from transformers import AutoConfig

    devices = recipe.trainer.rank_devices() + recipe.engine.engine_devices()
    if any(d != "cpu" for d in devices):
        return None
    threads = recipe.trainer.threads + recipe.engine.threads * recipe.engine.engines
    threads = min(threads, os.cpu_count() or 1)
    params = matmul_params(recipe.model)
    cfg = AutoConfig.from_pretrained(recipe.model)
    peak = matmul_peak(threads, cfg.hidden_size, cfg.intermediate_size)
    console.print(
        f"FLOP floor: {params / 1e6:.1f}M matmul weights, float32 matmul peak {peak:.1f} GFLOP/s "
        f"on {threads} threads"
    )
    return params, peak


def run_mode(
    recipe: Recipe,
    mode: str,
    run_dir: Path,
    steps: int,
    warmup: int,
    console: Console,
    live: bool,
    label: str | None = None,
    engines: EnginesFor | None = None,
) -> tuple[list[dict], tuple[float, float]]:
    """One training run of `warmup + steps` steps: its measured metrics rows and their time
    window."""
    from orbit.run.lifecycle import train

    shutil.rmtree(run_dir, ignore_errors=True)  # a bench re-run measures afresh
    r = recipe.model_copy(deep=True, update={"mode": mode, "out": run_dir})
    r.trainer.steps = warmup + steps
    r.trainer.save_every = warmup + steps  # one checkpoint at the end, not inside the timed steps
    console.print(
        f"[bold]bench[/] {label or recipe.engine.backend + ' ' + mode}: {warmup} warm-up + {steps} "
        "measured steps"
    )
    train(Checked(r), live=live, console=console, engines=engines)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    measured = rows[warmup:]
    return measured, _window(run_dir, measured)


def _print_targets(console: Console, rows: list[dict]) -> None:
    for t in rows:
        mark = "[green]met[/]" if t["met"] else "[red]missed[/]"
        ratio = "-" if t["ratio"] is None else f"{t['ratio']:.3f}"
        console.print(f"  target {t['target']}: ratio {ratio} {mark}")


def _window(run_dir: Path, measured: list[dict]) -> tuple[float, float]:
    """The wall-clock span of the measured steps, from the timeline's trainer events."""
    events = [json.loads(x) for x in (run_dir / "timeline.jsonl").read_text().splitlines()]
    trainer = [e for e in events if e["actor"] == "trainer"]
    first = measured[0]["step"]
    starts = [e["t0"] for e in trainer if e["kind"] == "wait" and e["version"] == first]
    end = max(e["t1"] for e in trainer)
    return (min(starts) if starts else min(e["t0"] for e in trainer), end)
