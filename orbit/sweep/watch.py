"""Watching a sweep: the live table of its runs, and the summary it leaves (summary.json, a ranked
table and reward.png, every run's reward curve in one picture).

Runs are ranked by their final reward: the mean `reward_mean` of their last `curves.WINDOW` steps.
Fairness between runs is shown, not assumed: each run's share of the trainer's time and its mean
wait for the trainer while other runs trained (`trainer_queue_s`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import fmean

from rich.console import Console
from rich.live import Live
from rich.table import Table

from orbit.metrics.curves import WINDOW, draw_curves
from orbit.metrics.steps import StepMetrics

SUMMARY_FILE = "summary.json"
PICTURE_FILE = "reward.png"


@dataclass
class RunStatus:
    """One run of a sweep, as the table shows it (written by its loop's thread, read by the
    table)."""

    name: str
    run_dir: Path
    steps: int
    state: str = "running"  # running | done | stopped | interrupted
    reason: str = ""  # why it stopped (the run's own one-line error)
    last: StepMetrics | None = None
    rewards: list[float] = field(default_factory=list)

    def stepped(self, m: StepMetrics) -> None:
        self.last = m
        self.rewards.append(m.reward_mean)

    def end(self, state: str, reason: str = "") -> None:
        self.state, self.reason = state, reason


class SweepTable:
    """A rich table of the runs (step, reward, staleness, tok/s, trainer wait, state), redrawn 4
    times a second. Silent when `enabled` is False."""

    def __init__(self, statuses: list[RunStatus], enabled: bool = True) -> None:
        self.statuses = statuses
        self._live = Live(self._render(), refresh_per_second=4) if enabled else None

    def __enter__(self) -> SweepTable:
        if self._live:
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live:
            self._live.update(self._render())
            self._live.__exit__(*exc)

    def refresh(self) -> None:
        if self._live:
            self._live.update(self._render())

    def _render(self) -> Table:
        table = Table(title="orbit sweep", title_justify="left")
        for column in (
            "run",
            "step",
            "reward",
            "reward (last 8)",
            "staleness",
            "tok/s",
            "trainer wait s",
            "state",
        ):
            table.add_column(column, justify="left" if column in ("run", "state") else "right")
        for s in self.statuses:
            m = s.last
            recent = s.rewards[-WINDOW:]
            table.add_row(
                s.name,
                f"{m.version if m else 0}/{s.steps}",
                f"{m.reward_mean:.3f}" if m else "-",
                f"{fmean(recent):.3f}" if recent else "-",
                f"{m.staleness_mean:.2f}" if m else "-",
                f"{m.trained_tokens / m.step_s:.0f}" if m and m.step_s > 0 else "-",
                f"{m.trainer_queue_s:.2f}" if m else "-",
                s.state if not s.reason else f"{s.state}: {s.reason.splitlines()[0][:60]}",
            )
        return table


@dataclass
class RunSummary:
    name: str
    run_dir: str
    state: str
    reason: str
    steps: int
    final_reward: float | None  # mean reward_mean over the last WINDOW steps
    best_reward: float | None
    staleness_mean: float | None
    train_s: float  # the trainer's time on this run's steps
    trainer_share: float  # of the trainer's time on every run's steps
    trainer_queue_s_mean: float | None  # waiting for the trainer per step, while other runs trained
    logprob_diff_max: float | None  # engine vs trainer on the same tokens, the worst step


def summarize(out: Path, statuses: list[RunStatus], extra: dict) -> list[RunSummary]:
    """summary.json and reward.png in the sweep's directory; returns the runs ranked by final
    reward."""
    rows = [_metrics(s.run_dir) for s in statuses]
    total_train = sum(sum(r["train_s"] for r in run) for run in rows) or 1.0
    runs = []
    for s, run in zip(statuses, rows, strict=True):
        rewards = [r["reward_mean"] for r in run]
        diffs = [r["logprob_diff"] for r in run if r.get("logprob_diff") is not None]
        train_s = sum(r["train_s"] for r in run)
        runs.append(
            RunSummary(
                name=s.name,
                run_dir=str(s.run_dir),
                state=s.state,
                reason=s.reason,
                steps=len(run),
                final_reward=fmean(rewards[-WINDOW:]) if rewards else None,
                best_reward=max(rewards, default=None),
                staleness_mean=fmean(r["staleness_mean"] for r in run) if run else None,
                train_s=train_s,
                trainer_share=train_s / total_train,
                trainer_queue_s_mean=fmean(r.get("trainer_queue_s", 0.0) for r in run)
                if run
                else None,
                logprob_diff_max=max(diffs, default=None),
            )
        )
    ranked = sorted(
        runs, key=lambda r: -r.final_reward if r.final_reward is not None else float("inf")
    )
    (out / SUMMARY_FILE).write_text(
        json.dumps({"runs": [asdict(r) for r in ranked], **extra}, indent=1)
    )
    stepped = {s.name: s.run_dir for s, run in zip(statuses, rows, strict=True) if run}
    if stepped:
        draw_curves(stepped, out / PICTURE_FILE, title=f"{out.name}: reward of each run")
    return ranked


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def print_summary(console: Console, ranked: list[RunSummary], out: Path) -> None:
    table = Table(
        title=f"{out}: runs ranked by final reward (mean of the last {WINDOW} steps)",
        title_justify="left",
    )
    for column in (
        "#",
        "run",
        "steps",
        "final reward",
        "best",
        "staleness",
        "trainer share",
        "trainer wait s/step",
        "logprob diff max",
        "state",
    ):
        table.add_column(column, justify="left" if column in ("run", "state") else "right")
    for i, r in enumerate(ranked, 1):
        table.add_row(
            str(i),
            r.name,
            str(r.steps),
            _f(r.final_reward),
            _f(r.best_reward),
            _f(r.staleness_mean, 2),
            f"{r.trainer_share:.0%}",
            _f(r.trainer_queue_s_mean, 2),
            _f(r.logprob_diff_max, 1, "e"),
            r.state,
        )
    console.print(table)


def _f(x: float | None, digits: int = 3, kind: str = "f") -> str:
    return "-" if x is None else f"{x:.{digits}{kind}}"
