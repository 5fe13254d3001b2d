"""Step metrics (docs/design.md §6), timeline events on one clock, JSON-lines writers and the live
view."""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Group as RichGroup
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

# The fields every metrics.jsonl line carries (the five-panel comparison reads these).
METRIC_FIELDS = (
    "mode",
    "step",
    "version",
    "update_weights_s",
    "train_wait_s",
    "rollout_tok_per_dev_s",
    "step_s",
    "staleness_mean",
    "staleness_max",
    "engine_paused_s",
    "logprob_diff",
    "reward_mean",
    "loss",
    "stale_dropped",
    "ratio_mean",
    "ratio_max",
    "clip_frac",
    "waste_frac",
    "useful_tok_per_dev_s",
    "flip_lag_s",
    "engines_alive",
    "rejoined",
    "pushes_refused",
    "train_s",
    "trainer_idle_s",
    "engine_busy_s",
    "entropy",
    "zero_variance_frac",
    "groups_filtered",
    "groups_screened",
    "lr",
)


@dataclass
class StepMetrics:
    mode: str
    step: int
    version: int  # adapter version after this step's optimizer update
    update_weights_s: float
    train_wait_s: float
    rollout_tok_per_dev_s: float
    step_s: float
    staleness_mean: float
    staleness_max: int
    engine_paused_s: float
    logprob_diff: float | None  # engine vs trainer on tokens of exactly the current weights
    reward_mean: float
    loss: float
    stale_dropped: int
    train_s: float = 0.0
    # a sweep's run waiting for the shared trainer while other runs trained
    trainer_queue_s: float = 0.0
    # a sweep's runs whose steps shared this step's passes over the base, its own included
    trainer_packed: int = 1
    trainer_idle_s: float = 0.0  # train_wait_s + the part of the push that held the trainer
    # the engines' own busy time in the step (generating), summed over engines
    engine_busy_s: float = 0.0
    tokens_generated: int = 0
    logprob_diff_tokens: int = 0
    policy_drift: float | None = None  # same mean abs diff, over samples of older weights
    grad_norm: float = 0.0
    full_push: bool = False
    # OFT pushed as merged weights of the adapted modules (engine has no OFT slots)
    merged_push: bool = False
    resubmitted: int = 0
    ratio_mean: float | None = None  # p_trainer / p_engine over the trained tokens
    ratio_max: float | None = None
    clip_frac: float | None = None  # share of tokens whose weight was truncated or clipped
    trained_tokens: int = 0  # model tokens of the samples trained on
    waste_frac: float = 0.0  # tokens of dropped or aborted samples / tokens generated in the step
    useful_tok_per_dev_s: float = 0.0  # trained tokens / step_s / engines
    # from the push of the newest version every engine serves to its last flip
    flip_lag_s: float | None = None
    engines_alive: int = 1
    # engines that came back into the pool so far (restarted, or a server answering again)
    rejoined: int = 0
    pushes_refused: int = 0  # pushes an engine refused so far (it kept serving what it had)
    # per engine: how adapters reach it
    adapter_transport: list[str] = field(default_factory=list)
    # mean entropy of the sampling distribution over the trained tokens
    entropy: float | None = None
    # share of the step's groups (trained and filtered) whose rewards were all equal
    zero_variance_frac: float = 0.0
    # groups dynamic sampling dropped in the step (not waste: they carried no signal)
    groups_filtered: int = 0
    # of those, prompts dropped on their probe (staged sampling: their group never generated)
    groups_screened: int = 0
    # agent episodes lost in the step (the agent raised, hung, or gave no number)
    episodes_lost: int = 0
    truncated_frac: float = 0.0  # share of the batch's samples cut by max_new_tokens
    masked_frac: float = 0.0  # share of trained tokens the algorithm's mask band dropped
    lr: float = 0.0  # the learning rate of the step's last optimizer step
    optimizer_steps: int = 1  # optimizer steps taken on the batch (algorithm.minibatches × epochs)
    # the trainer's achieved rate: its matmul FLOPs / train_s (the peak:
    # bench/investigations/cores.py)
    trainer_tflops: float = 0.0
    # share of the trainer's thread checks that borrowed the idle engines' cores
    borrowed_frac: float = 0.0
    # task figures: correct_rate, format_rate, failure_modes
    extra: dict = field(default_factory=dict)

    def to_json(self) -> str:
        d = asdict(self)
        d.update(d.pop("extra"))
        return json.dumps({k: _clean(v) for k, v in d.items()})


def _clean(v):
    """JSON has no NaN: report missing measurements as null."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class JsonlWriter:
    """Append-only JSON lines, flushed on every write so Ctrl-C loses nothing."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = path.open("a", buffering=1)
        self._lock = threading.Lock()

    def write(self, line: str) -> None:
        with self._lock:
            if not self._f.closed:
                self._f.write(line + "\n")

    def close(self) -> None:
        """Flush and close. Idempotent: a stopped run closes early, and the normal path again."""
        with self._lock:
            if not self._f.closed:
                self._f.flush()
                self._f.close()


class Timeline:
    """Events (actor, kind, t0, t1, version) on the wall clock shared by trainer and engine."""

    def __init__(self, path: Path) -> None:
        self._out = JsonlWriter(path)

    def event(
        self, actor: str, kind: str, t0: float, t1: float, version: int | None, **extra
    ) -> None:
        row = {"actor": actor, "kind": kind, "t0": t0, "t1": t1, "version": version, **extra}
        self._out.write(json.dumps(row))

    def span(self, actor: str, kind: str, version: int | None, **extra) -> _Span:
        return _Span(self, actor, kind, version, extra)

    def close(self) -> None:
        self._out.close()


class _Span:
    """`with timeline.span(...)`: records the event when the block ends; `.seconds` after."""

    def __init__(self, timeline: Timeline, actor: str, kind: str, version, extra) -> None:
        self.timeline, self.actor, self.kind, self.version, self.extra = (
            timeline,
            actor,
            kind,
            version,
            extra,
        )
        self.seconds = 0.0

    def __enter__(self) -> _Span:
        self.t0 = time.time()
        return self

    def __exit__(self, *exc) -> None:
        t1 = time.time()
        self.seconds = t1 - self.t0
        self.timeline.event(self.actor, self.kind, self.t0, t1, self.version, **self.extra)


class LiveView:
    """A rich progress bar plus the latest step's figures. Silent when `enabled` is False."""

    def __init__(self, mode: str, total_steps: int, start_step: int, enabled: bool = True) -> None:
        self.enabled = enabled
        self.progress = Progress(
            TextColumn(f"[bold]{mode}[/]"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()
        )
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step)
        self.flips = 0
        self.last: StepMetrics | None = None
        self.versions: list[int | None] = []
        self._live = Live(self._render(), refresh_per_second=4) if enabled else None

    def __enter__(self) -> LiveView:
        if self._live:
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live:
            self._live.__exit__(*exc)

    def update(
        self, m: StepMetrics, flipped: bool, versions: list[int | None] | None = None
    ) -> None:
        self.flips += int(flipped)
        self.last = m
        self.versions = versions or []
        self.progress.update(self.task, completed=m.step + 1)
        if self._live:
            self._live.update(self._render())

    def _render(self):
        table = Table(box=None, show_header=True, header_style="bold cyan")
        for col in (
            "step",
            "reward",
            "step s",
            "train wait s",
            "push s",
            "staleness",
            "dropped",
            "logprob diff",
            "flips",
            "engine versions",
        ):
            table.add_column(col, justify="right")
        m = self.last
        if m is not None:
            diff = (
                "-"
                if m.logprob_diff is None or not math.isfinite(m.logprob_diff)
                else f"{m.logprob_diff:.2e}"
            )
            table.add_row(
                str(m.step),
                f"{m.reward_mean:.3f}",
                f"{m.step_s:.2f}",
                f"{m.train_wait_s:.2f}",
                f"{m.update_weights_s:.3f}",
                f"{m.staleness_mean:.2f}/{m.staleness_max}",
                str(m.stale_dropped),
                diff,
                str(self.flips),
                " ".join("gone" if v is None else f"v{v}" for v in self.versions),
            )
        return RichGroup(self.progress, table)
