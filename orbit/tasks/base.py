"""What a task is: a stream of prompts and a verifier that scores completions.

A task is any object with
- `name: str`
- `prompts(seed, split="train") -> Iterator[Prompt]`: endless and deterministic for a seed;
  `split="eval"` draws from held-out prompts that the train split never yields;
- `score(prompt, output_ids) -> Score`: the reward and `info` (`correct`, `format_ok`,
  `failure_mode`, ...) of everything generated after the prompt (tool results included).

A multi-turn task (tool use) adds
- `next_turn(prompt, transcript_ids) -> list[int] | None`: called after each model turn with
  everything after the prompt so far; returns the tokens to inject (a tool result) and the model
  continues after them, or None when the episode is over;
- `max_turns: int`: model turns per episode at most.

Optional on any task: `stop_token_ids` (tuple of ints) ends a model turn besides eos (a multi-turn
task puts its tool-call end marker here), `demonstration(prompt) -> list[Segment]` (a correct
episode, used by the warm start), and `close()` (stop what the task started, e.g. a checker process;
called when the run or the evaluation ends).

A task that fails (raises) while the run is going is a `TaskError`: the run stops with the
prompt id and the task's own message, and keeps what it has written.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

Split = Literal["train", "eval"]
SPLITS: tuple[str, ...] = ("train", "eval")
FAILURE_MODES: tuple[str, ...] = ("success", "wrong_format", "tool_spam", "wrong_answer")


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    prompt_ids: tuple[int, ...]
    answer: str = ""
    # task's own data (e.g. a tool table)
    meta: dict = field(default_factory=dict, compare=False, hash=False)


@dataclass
class Score:
    reward: float
    info: dict = field(default_factory=dict)  # correct, format_ok, failure_mode, ...


@dataclass(frozen=True)
class Segment:
    """Part of a demonstration: tokens and whether the model writes them (True) or a tool does."""

    ids: tuple[int, ...]
    trained: bool


class TaskError(RuntimeError):
    """A task failed while the run was going (its own code raised)."""


@runtime_checkable
class Task(Protocol):
    name: str

    def prompts(self, seed: int, split: Split = "train") -> Iterator[Prompt]:
        """An endless, deterministic stream of prompts for this seed and split."""
        ...

    def score(self, prompt: Prompt, output_ids: list[int]) -> Score: ...


@runtime_checkable
class MultiTurnTask(Task, Protocol):
    max_turns: int

    def next_turn(self, prompt: Prompt, transcript_ids: list[int]) -> list[int] | None: ...


def is_multi_turn(task: object) -> bool:
    return callable(getattr(task, "next_turn", None))


def is_agent(task: object) -> bool:
    """An agent task (orbit/tasks/agent.py): its episodes are the user's agent code, run, not
    generated."""
    return getattr(task, "agent", False) is True


def task_stop_ids(task: object) -> tuple[int, ...]:
    return tuple(int(t) for t in getattr(task, "stop_token_ids", ()) or ())


def close_task(task: object) -> None:
    """Stop what a task started (the math tasks' checker process); a task with nothing to stop has
    no `close`."""
    close = getattr(task, "close", None)
    if callable(close):
        close()


def check_task(task: object, where: str) -> None:
    """Raise TypeError unless `task` has what a task needs (name, prompts, score; next_turn's
    partner)."""
    missing = [a for a in ("name", "prompts", "score") if not hasattr(task, a)]
    missing += [
        a for a in ("prompts", "score") if hasattr(task, a) and not callable(getattr(task, a))
    ]
    if missing:
        raise TypeError(
            f"{where} returned {type(task).__name__}, which is not a task: it lacks "
            f"{sorted(set(missing))} (a task has name, prompts(seed, split), score(prompt, "
            "output_ids); see orbit/tasks/base.py)"
        )
    if is_multi_turn(task):
        turns = getattr(task, "max_turns", None)
        if not isinstance(turns, int) or isinstance(turns, bool) or turns < 1:
            raise TypeError(
                f"{where}: a multi-turn task (it has next_turn) needs max_turns >= 1, got {turns!r}"
            )


def answer_tag(text: str) -> str | None:
    """The content of the last complete <answer>...</answer> in `text`, stripped; None if there is
    none."""
    end = text.rfind("</answer>")
    if end < 0:
        return None
    start = text.rfind("<answer>", 0, end)
    if start < 0:
        return None
    return text[start + len("<answer>") : end].strip()
