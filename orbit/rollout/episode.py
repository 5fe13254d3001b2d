"""Multi-turn rollouts: a chain of `engine.generate` calls with tool results injected between them.

An episode starts from the prompt. After each model turn the task's `next_turn(prompt, transcript)`
either returns tokens to inject (a tool result; the model continues after them, with the new
prompt = prompt + everything so far, which the engine's prefix cache makes cheap) or None (done).
The result is one sample: the model's tokens (loss_mask 1, their engine logprobs) and the injected
tokens (loss_mask 0, logprob 0.0) in order; version_start from the first turn, version_end from
the last. Turns are capped by the task's `max_turns` and by the engine's context.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from orbit.engine.base import Completion, SamplingParams
from orbit.tasks.base import Prompt, Task, TaskError, task_stop_ids


@dataclass
class Episode:
    """One rollout in progress; once done it reads like a Completion, plus `loss_mask`."""

    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per output token (Sample.token_versions)
    turns: int = 0  # model turns so far
    tool_results: int = 0  # injections so far
    version_start: int = 0
    version_end: int = 0
    finish_reason: str = "stop"
    slot: int | None = None
    t_start: float = 0.0
    t_end: float = 0.0

    def context(self) -> list[int]:
        """What the model sees for its next turn."""
        return self.prompt_ids + self.output_ids

    def add_turn(self, c: Completion) -> None:
        if self.turns == 0:
            self.version_start, self.t_start = c.version_start, c.t_start
        self.version_end, self.t_end, self.slot = c.version_end, c.t_end, c.slot
        self.finish_reason = c.finish_reason
        self.output_ids += list(c.output_ids)
        self.logprobs += list(c.logprobs)
        self.loss_mask += [1] * len(c.output_ids)
        self.versions += [c.token_version] * len(c.output_ids)
        self.turns += 1

    def inject(self, ids: list[int]) -> None:
        self.output_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)
        self.versions += [-1] * len(ids)
        self.tool_results += 1


def with_task_stops(sampling: SamplingParams, task: Task) -> SamplingParams:
    """The sampling parameters with the task's own stop tokens (a tool call's end) added."""
    stops = tuple(dict.fromkeys(sampling.stop_token_ids + task_stop_ids(task)))
    return dataclasses.replace(sampling, stop_token_ids=stops)


def continue_episode(task: Task, prompt: Prompt, episode: Episode, max_context: int | None) -> bool:
    """After a model turn was added: inject the task's tool result and return True if the model
    takes another turn; False when the episode is over (the task said so, or a cap was reached)."""
    if episode.finish_reason != "stop" or episode.turns >= getattr(task, "max_turns", 1):
        return False  # out of tokens in this turn, or of turns
    try:
        injected = task.next_turn(prompt, list(episode.output_ids))  # type: ignore[attr-defined]
    except Exception as err:  # noqa: BLE001 - a failing tool stops the run, named
        raise TaskError(
            f"task {getattr(task, 'name', '?')!r}: next_turn (the tool) failed on prompt "
            f"{prompt.id!r} after turn {episode.turns}: {type(err).__name__}: {err}"
        ) from err
    if injected is None:
        return False
    if not isinstance(injected, list | tuple) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in injected
    ):
        raise TaskError(
            f"task {getattr(task, 'name', '?')!r}: next_turn must return a list of token ids or "
            f"None, got {type(injected).__name__} on prompt {prompt.id!r}"
        )
    episode.inject(list(injected))
    if max_context is not None and len(episode.context()) + 1 >= max_context:
        return False  # no room left for the model to write anything
    return True
