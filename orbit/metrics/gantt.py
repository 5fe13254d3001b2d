"""Five Gantt panels on one shared time axis, drawn from each mode's timeline.jsonl.

Engine lanes: one bar per request, colored by the policy version it started with, packed into
lanes as an interval schedule. Trainer lane: wait / train / push, with the engine's pause on
top. At serial barriers the idle tail of each lane (waiting for the slowest sample) is hatched.
Flips and weight updates are marked with vertical lines; a mode's floor (the fastest its steps could
be on this machine, orbit/measure/bench.py) as dotted green lines where its steps would end at that
pace.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from orbit.config.modes import MODES  # noqa: E402

TRAINER_COLORS = {"wait": "#d9d9d9", "train": "#4c72b0", "push": "#dd8452", "save": "#8c8c8c"}
PAUSE_COLOR = "#c44e52"
FLOOR_COLOR = "#2ca02c"
VERSION_CMAP = plt.get_cmap("tab10")


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "timeline.jsonl").read_text().splitlines()]


def pack_lanes(requests: list[dict]) -> list[int]:
    """Greedy interval partitioning: each request gets the first lane free at its start."""
    lane_end: list[float] = []
    lanes = []
    for r in requests:
        for i, end in enumerate(lane_end):
            if end <= r["t0"]:
                lane_end[i] = r["t1"]
                lanes.append(i)
                break
        else:
            lane_end.append(r["t1"])
            lanes.append(len(lane_end) - 1)
    return lanes


def engine_bands(
    requests: list[dict], engines: set[int] | None = None
) -> tuple[list[int], list[tuple[int, float, float]]]:
    """Lanes for requests with each engine in a band of its own: (lane per request, and per engine
    (index, first lane, last lane + 1)). `engines`: every engine to show, idle ones included."""
    shown = sorted({r.get("engine", 0) for r in requests} | (engines or set()))
    lanes = [0] * len(requests)
    bands: list[tuple[int, float, float]] = []
    base = 0
    for engine in shown:
        idx = [i for i, r in enumerate(requests) if r.get("engine", 0) == engine]
        packed = pack_lanes([requests[i] for i in idx])
        for i, lane in zip(idx, packed, strict=True):
            lanes[i] = base + lane
        height = max(packed, default=0) + 1  # an idle engine keeps a visible (empty) lane
        bands.append((engine, base, base + height))
        base += height + (1 if len(shown) > 1 else 0)  # a gap between bands
    return lanes, bands


def _draw_mode(
    ax, mode: str, events: list[dict], t0: float, t1: float, title: str | None = None
) -> None:
    requests = sorted(
        (e for e in events if e["kind"] == "request" and e["t1"] > t0 and e["t0"] < t1),
        key=lambda e: e["t0"],
    )
    updated = {
        e.get("engine", 0) for e in events if e["actor"] == "engine" and e["kind"] == "update"
    }
    lanes, bands = engine_bands(requests, updated)
    # idle engines too
    n_lanes = max((hi for _, _, hi in bands), default=max(lanes, default=-1) + 1)
    trainer_y = n_lanes + 1
    for r, lane in zip(requests, lanes, strict=True):
        aborted = r.get("finish") == "abort"
        ax.broken_barh(
            [(r["t0"] - t0, r["t1"] - r["t0"])],
            (lane + 0.1, 0.8),
            facecolors="white" if aborted else VERSION_CMAP(r["version"] % 10),
            edgecolors="black" if aborted else "none",
            linewidth=0.3,
        )
    if MODES[mode].loop == "serial":
        _hatch_stragglers(ax, requests, lanes, events, t0)
    for e in events:
        if e["actor"] == "trainer" and e["kind"] in TRAINER_COLORS and e["t1"] > t0:
            ax.broken_barh(
                [(e["t0"] - t0, e["t1"] - e["t0"])],
                (trainer_y, 1.2),
                facecolors=TRAINER_COLORS[e["kind"]],
            )
        if e["actor"] == "engine" and e["kind"] == "paused" and e["t1"] > t0:
            ax.broken_barh(
                [(e["t0"] - t0, max(e["t1"] - e["t0"], 1e-3))],
                (trainer_y + 0.3, 0.6),
                facecolors=PAUSE_COLOR,
            )
            ax.axvline(e["t1"] - t0, color=PAUSE_COLOR, linestyle="--", linewidth=0.7, alpha=0.7)
    for e in events:  # an engine's own flips (or loads) on its band
        if (
            e["actor"] == "engine"
            and e["kind"] in ("load_adapter", "lost")
            and t0 < e["t1"] < t1
            and len(bands) > 1
        ):
            band = next((b for b in bands if b[0] == e.get("engine", 0)), None)
            if band is not None:
                color = "black" if e["kind"] == "lost" else PAUSE_COLOR
                ax.plot([e["t1"] - t0] * 2, [band[1], band[2]], color=color, linewidth=1.2)
    if len(bands) > 1:
        ticks = [((lo + hi) / 2, f"engine {i}") for i, lo, hi in bands]
        ax.set_yticks(
            [y for y, _ in ticks] + [trainer_y + 0.6], [t for _, t in ticks] + ["trainer"]
        )
    else:
        ax.set_yticks([n_lanes / 2, trainer_y + 0.6], ["engine", "trainer"])
    ax.set_ylim(-0.5, trainer_y + 1.7)
    m = MODES[mode]
    ax.set_title(title or f"{mode}  ({m.loop} loop, {m.push} push)", loc="left", fontsize=10)


def _draw_floor(ax, floor_s: float, span: float, steps: float) -> None:
    """Where each step would end if every step ran at the floor; the label compares the paces."""
    for k in range(1, int(span / floor_s) + 1):
        ax.axvline(k * floor_s, color=FLOOR_COLOR, linestyle=":", linewidth=1.0)
    ax.text(
        0.995,
        0.02,
        f"floor {floor_s:.2f} s/step: {span / floor_s:.1f} steps in this time, {steps:.0f} run",
        transform=ax.transAxes,
        ha="right",
        va="bottom",
        fontsize=8,
        color=FLOOR_COLOR,
    )


def _hatch_stragglers(ax, requests, lanes, events, t0) -> None:
    """At each serial barrier, the time a lane sat idle waiting for the batch's slowest sample."""
    for w in (e for e in events if e["actor"] == "trainer" and e["kind"] == "wait"):
        last_end: dict[int, float] = {}
        for r, lane in zip(requests, lanes, strict=True):
            if w["t0"] <= r["t0"] and r["t1"] <= w["t1"] + 1e-3:
                last_end[lane] = max(last_end.get(lane, 0.0), r["t1"])
        for lane, end in last_end.items():
            if w["t1"] - end > 0:
                ax.broken_barh(
                    [(end - t0, w["t1"] - end)],
                    (lane + 0.1, 0.8),
                    facecolors="none",
                    edgecolors="#999999",
                    hatch="////",
                    linewidth=0,
                )


def draw_panels(
    bench_dir: Path,
    windows: dict[str, tuple[float, float]],
    path: Path,
    floors: dict[str, float] | None = None,
    title: str | None = None,
    titles: dict[str, str] | None = None,
    modes: dict[str, str] | None = None,
) -> Path:
    """One panel per run (bench_dir/<key>), all on the same time axis (seconds from each run's first
    measured step). `floors`: per key, a floor to draw; `modes`: per key, its mode (default the
    key)."""
    keys = list(windows)
    span = max(t1 - t0 for t0, t1 in windows.values())
    fig, axes = plt.subplots(
        len(keys), 1, figsize=(14, 2.6 * len(keys)), sharex=True, squeeze=False
    )
    for ax, key in zip(axes[:, 0], keys, strict=True):
        t0, t1 = windows[key]
        events = _events(bench_dir / key)
        _draw_mode(ax, (modes or {}).get(key, key), events, t0, t1, (titles or {}).get(key))
        if floors and floors.get(key):
            steps = sum(
                1
                for e in events
                if e["actor"] == "trainer" and e["kind"] == "train" and t0 <= e["t0"] < t1
            )
            _draw_floor(ax, floors[key], t1 - t0, steps)
        ax.set_xlim(0, span)
    axes[-1, 0].set_xlabel("seconds since the first measured step (one shared axis)")
    legend = [Patch(facecolor=c, label=k) for k, c in TRAINER_COLORS.items()]
    legend += [
        Patch(facecolor=PAUSE_COLOR, label="engine paused / flip"),
        Patch(
            facecolor="none", edgecolor="#999999", hatch="////", label="straggler wait at barrier"
        ),
        Patch(facecolor="white", edgecolor="black", label="aborted request"),
    ]
    if floors:
        legend.append(Patch(facecolor=FLOOR_COLOR, label="step ends at the floor's pace"))
    legend += [Patch(facecolor=VERSION_CMAP(v), label=f"version {v} (mod 10)") for v in range(3)]
    if title:
        fig.suptitle(title, x=0.01, ha="left", fontsize=12, fontweight="bold")
    fig.legend(
        handles=legend,
        loc="upper center",
        ncol=6,
        fontsize=8,
        frameon=False,
        bbox_to_anchor=(0.5, 0.975 if title else 1.0),
    )
    fig.tight_layout(rect=(0, 0, 1, 0.93 if title else 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
