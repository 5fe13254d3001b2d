"""Learning curves as pictures: a metric of one or more runs over their steps, from metrics.jsonl.

`orbit curves RUN_DIR [RUN_DIR ...] --metric reward_mean --out curves.png` draws each run's per-step
values faintly and a moving average over them boldly, one colour per run, one picture for all (a
sweep's K runs side by side).
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

WINDOW = 8  # steps in the moving average


def read_metric(run_dir: Path, metric: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `metric` in a run's metrics.jsonl; steps without a value are left out."""
    steps, values = [], []
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if isinstance(row.get(metric), int | float):
            steps.append(row["step"])
            values.append(float(row[metric]))
    return steps, values


def moving_average(values: list[float], window: int = WINDOW) -> list[float]:
    """The mean of each value with up to `window - 1` before it."""
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1) : i + 1]
        out.append(sum(part) / len(part))
    return out


def draw_curves(
    runs: dict[str, Path], path: Path, metric: str = "reward_mean", title: str | None = None
) -> Path:
    """One picture: `metric` over steps for each run (label -> run directory)."""
    fig, ax = plt.subplots(figsize=(9, 4.5))
    colors = plt.get_cmap("tab10")
    for i, (label, run_dir) in enumerate(runs.items()):
        steps, values = read_metric(run_dir, metric)
        ax.plot(steps, values, color=colors(i % 10), alpha=0.25, linewidth=1)
        ax.plot(
            steps,
            moving_average(values),
            color=colors(i % 10),
            linewidth=2,
            label=f"{label} (mean of the last {WINDOW} steps)",
        )
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    if title:
        ax.set_title(title, loc="left", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
