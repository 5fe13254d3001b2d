"""How a run ends: every way, its exit code, and what is on disk afterwards. One table, used by `orbit train`
and `orbit sweep` (each run of a sweep ends in one of these ways; the sweep exits 0, 1 or 130), and shown as
it is in docs/operations.md (tests/test_docs.py keeps the two the same).

Whatever the way, a run's directory agrees with itself: every optimizer step that reached the adapter has its
metrics.jsonl line, and the newest checkpoint is the last line's step (docs/design.md §7).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class End:
    name: str
    code: int  # the command's exit code
    when: str
    saved: str


ENDS: tuple[End, ...] = (
    End("success", 0, "every step done", "every step's metrics line; the last step's checkpoint (RUN_DIR/adapter)"),
    End("ctrl-c", 130, "Ctrl-C (the step in progress finishes first)",
        "that step's line and checkpoint; `--resume RUN_DIR` continues"),
    End("sigterm", 130, "SIGTERM (a launcher or scheduler stopping the run), handled as Ctrl-C",
        "as Ctrl-C"),
    End("engine-lost", 1, "every engine gone and none coming back (engine.restarts spent)",
        "the last step's line and checkpoint"),
    End("rank-lost", 1, "a trainer rank died or stopped answering (trainer.rank_timeout_s)",
        "rank 0 saves the last complete step"),
    End("stall", 1, "rollouts cannot go on: nothing arrived for rollout.stall_timeout_s, a sample aborted "
        "rollout.max_attempts times, dynamic sampling found no signal, agent episodes kept failing",
        "the last step's line and checkpoint; the message says what was seen"),
    End("task-failed", 1, "the task's own code raised (its prompts, score or tool)",
        "the last step's line and checkpoint; the message names the prompt"),
    End("bad-push", 1, "an engine refused 3 pushes in a row (serial modes and the barrier: the first)",
        "the last step's line and checkpoint; the engine kept serving its previous slot"),
    End("non-finite", 1, "a non-finite gradient norm (the update is not made)",
        "the last finite step's line and checkpoint"),
    End("save-failed", 1, "a checkpoint could not be written (a full disk)",
        "what that save wrote is removed; the previous checkpoint stays current"),
    End("engine-start", 3, "an engine or server did not start", "nothing trained, nothing left in the way"),
    End("bad-recipe", 2, "a bad recipe, data file or argument, found before any compute",
        "nothing; the message names the field, file or row"),
)
BY_NAME = {e.name: e for e in ENDS}


class RunStopped(RuntimeError):
    """The run could not go on (an engine died, rollouts stalled or kept failing). The message
    says what happened and what was saved; `end` names the way it ended (orbit/ends.py)."""

    def __init__(self, message: str, end: str = "stall") -> None:
        super().__init__(message)
        self.end = end


def end_of(err: BaseException) -> End:
    """The way an error that stopped a run ends it."""
    from orbit.config import RecipeError
    from orbit.engine.base import EngineDeadError, EngineError, EngineStartError
    from orbit.interrupts import Interrupted
    from orbit.tasks import TaskError

    if isinstance(err, Interrupted | KeyboardInterrupt):
        return BY_NAME["ctrl-c"]
    if isinstance(err, RunStopped):
        return BY_NAME[err.end]
    if isinstance(err, RecipeError):
        return BY_NAME["bad-recipe"]
    if isinstance(err, EngineStartError):
        return BY_NAME["engine-start"]
    if isinstance(err, TaskError):
        return BY_NAME["task-failed"]
    if isinstance(err, EngineDeadError):
        return BY_NAME["engine-lost"]
    if isinstance(err, EngineError):
        return BY_NAME["bad-push"]
    raise err


def table() -> str:
    """The table as docs/operations.md shows it."""
    rows = ["| how the run ends | exit code | when | what is saved |", "|---|---|---|---|"]
    rows += [f"| {e.name} | {e.code} | {e.when} | {e.saved} |" for e in ENDS]
    return "\n".join(rows)


def stopped_by(cause: BaseException) -> tuple[str, str]:
    """The way an error that stopped the loop ends the run, and how the message says it."""
    from orbit.engine.base import EngineDeadError, EngineError
    from orbit.train.ranks import RankLost

    if isinstance(cause, EngineDeadError):
        return "engine-lost", "the engine died"
    if isinstance(cause, EngineError):
        return "bad-push", "an engine refused the new version"
    if isinstance(cause, FloatingPointError):
        return "non-finite", "training cannot go on"
    if isinstance(cause, RankLost):
        return "rank-lost", "a trainer rank was lost"
    return "stall", "rollouts cannot go on"


def sentence(text: str) -> str:
    """`text` ending in a full stop, so that the next line reads as a sentence of its own."""
    return text if text.rstrip().endswith((".", "!", "?")) else text.rstrip() + "."
