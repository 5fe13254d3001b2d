"""How a run ends: every way, its exit code, and what is on disk afterwards. One table, and one
judge (`judge`) that says which row an error or a stop falls in and how to say it: `orbit train`,
`orbit sweep` (each run of a sweep ends in one of these ways; the sweep exits 0, 1 or 130) and the
run itself ask it. The table is shown as it is in docs/operations.md (tests/test_docs.py keeps the
two the same).

Whatever the way, a run's directory agrees with itself: every optimizer step that reached the
adapter has its metrics.jsonl line, and the newest checkpoint is the last line's step
(docs/design.md §7).
"""

from __future__ import annotations

from dataclasses import dataclass

from orbit.config import RecipeError
from orbit.engine.base import EngineDeadError, EngineError, EngineStartError
from orbit.host.interrupts import Interrupted
from orbit.rollout.pipeline import RolloutError
from orbit.tasks import TaskError
from orbit.train.checkpoint import CheckpointError
from orbit.train.ranks import RankLost


@dataclass(frozen=True)
class End:
    name: str
    code: int  # the command's exit code
    when: str
    saved: str


ENDS: tuple[End, ...] = (
    End(
        "success",
        0,
        "every step done",
        "every step's metrics line; the last step's checkpoint (RUN_DIR/adapter)",
    ),
    End(
        "ctrl-c",
        130,
        "Ctrl-C (the step in progress finishes first)",
        "that step's line and checkpoint; `--resume RUN_DIR` continues",
    ),
    End(
        "sigterm",
        130,
        "SIGTERM (a launcher or scheduler stopping the run), handled as Ctrl-C",
        "as Ctrl-C",
    ),
    End(
        "engine-lost",
        1,
        "every engine gone and none coming back (engine.restarts spent)",
        "the last step's line and checkpoint",
    ),
    End(
        "rank-lost",
        1,
        "a trainer rank died or stopped answering (trainer.rank_timeout_s)",
        "rank 0 saves the last complete step",
    ),
    End(
        "stall",
        1,
        "rollouts cannot go on: nothing arrived for rollout.stall_timeout_s, a sample aborted "
        "rollout.max_attempts times, dynamic sampling found no signal, agent episodes kept failing",
        "the last step's line and checkpoint; the message says what was seen",
    ),
    End(
        "task-failed",
        1,
        "the task's own code raised (its prompts, score or tool)",
        "the last step's line and checkpoint; the message names the prompt",
    ),
    End(
        "bad-push",
        1,
        "an engine refused 3 pushes in a row (serial modes and the barrier: the first)",
        "the last step's line and checkpoint; the engine kept serving its previous slot",
    ),
    End(
        "non-finite",
        1,
        "a non-finite gradient norm (the update is not made)",
        "the last finite step's line and checkpoint",
    ),
    End(
        "save-failed",
        1,
        "a checkpoint could not be written (a full disk)",
        "what that save wrote is removed; the previous checkpoint stays current",
    ),
    End(
        "engine-start",
        3,
        "an engine or server did not start",
        "nothing trained, nothing left in the way",
    ),
    End(
        "bad-recipe",
        2,
        "a bad recipe, data file or argument, found before any compute",
        "nothing; the message names the field, file or row",
    ),
)
BY_NAME = {e.name: e for e in ENDS}


class RunStopped(RuntimeError):
    """The run could not go on (an engine died, rollouts stalled or kept failing, the task raised).
    The message says what happened and what was saved; `end` names the way it ended (an `ENDS`
    row)."""

    def __init__(self, message: str, end: str = "stall") -> None:
        super().__init__(message)
        self.end = end


@dataclass(frozen=True)
class Verdict:
    """The way a run (or a command) ended, and the words for what happened."""

    end: End
    reason: str

    def line(self, what: str) -> str:
        """The command line's one message: `what` is the thing that ended ("the run", "the
        sweep")."""
        if self.end.name in ("bad-recipe", "task-failed", "ctrl-c", "sigterm"):
            return self.reason
        if self.end.name == "engine-start":
            return f"{what} did not start: {self.reason}"
        return f"{what} stopped: {self.reason}"


# What each kind of error says happened, before its own message. Looked up in order: the first match
# wins.
_CAUSES: tuple[tuple[type[BaseException], str, str], ...] = (
    (RecipeError, "bad-recipe", ""),
    (EngineStartError, "engine-start", ""),
    (TaskError, "task-failed", "the task failed"),
    (CheckpointError, "save-failed", ""),
    (EngineDeadError, "engine-lost", "the engine died"),
    (EngineError, "bad-push", "an engine refused the new version"),
    (FloatingPointError, "non-finite", "training cannot go on"),
    (RankLost, "rank-lost", "a trainer rank was lost"),
    (RolloutError, "stall", "rollouts cannot go on"),
)


def judge(err: BaseException) -> Verdict | None:
    """The `ENDS` row an error that ended a run falls in, and what to say. None: no way a run ends
    (a bug, whose traceback is the report). A producer's failure is judged by its cause."""
    if isinstance(err, Interrupted | KeyboardInterrupt):
        return Verdict(BY_NAME["ctrl-c"], str(err))
    if isinstance(err, RunStopped):
        return Verdict(BY_NAME[err.end], str(err))
    if isinstance(err, RolloutError) and err.__cause__ is not None:
        return judge(err.__cause__)
    for kind, end, says in _CAUSES:
        if isinstance(err, kind):
            return Verdict(BY_NAME[end], f"{says}: {err}" if says else str(err))
    return None


def table() -> str:
    """The table as docs/operations.md shows it."""
    rows = ["| how the run ends | exit code | when | what is saved |", "|---|---|---|---|"]
    rows += [f"| {e.name} | {e.code} | {e.when} | {e.saved} |" for e in ENDS]
    return "\n".join(rows)


def sentence(text: str) -> str:
    """`text` ending in a full stop, so that the next line reads as a sentence of its own."""
    return text if text.rstrip().endswith((".", "!", "?")) else text.rstrip() + "."
