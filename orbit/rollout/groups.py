"""Groups: the `group_size` scored samples of one prompt, and the algorithm applied to them.

The producer scores a group when its last sample is done (`build_group`). Whether the group carries
any signal (`Signal`, for dynamic sampling) is known then; its advantages are set when the trainer
takes its batch (`set_advantages`), since one estimator (`batch`) looks at the whole batch. The math
itself is orbit/rl's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from orbit import rl
from orbit.agents.runner import AgentEpisode
from orbit.rl import AlgorithmConfig
from orbit.rollout.sample import Sample
from orbit.tasks.base import Prompt, Task, TaskError


@dataclass
class Group:
    """The `group_size` scored samples of one prompt."""

    prompt: Prompt
    samples: list[Sample]
    id: int = 0  # the producer's group number: admission order

    @property
    def tokens(self) -> int:
        """Tokens the model generated for this group (injected tool tokens excluded)."""
        return sum(sum(s.loss_mask) for s in self.samples)

    @property
    def oldest_version(self) -> int:
        return min(s.version_start for s in self.samples)

    def staleness(self, version: int) -> int:
        return version - self.oldest_version


def score(task: Task, prompt: Prompt, output_ids: list[int]):
    """`task.score`, with a failure named as the task's (TaskError)."""
    try:
        result = task.score(prompt, list(output_ids))
    except Exception as err:  # noqa: BLE001 - a failing verifier stops the run, named
        raise TaskError(
            f"task {getattr(task, 'name', '?')!r}: score failed on prompt {prompt.id!r}: "
            f"{type(err).__name__}: {err}"
        ) from err
    if not hasattr(result, "reward") or not isinstance(result.reward, int | float):
        raise TaskError(
            f"task {getattr(task, 'name', '?')!r}: score must return a Score(reward, info), got "
            f"{type(result).__name__}"
        )
    return result


def build_group(task: Task, prompt: Prompt, completions: list, group_id: int) -> Group:
    """Score each completion. A completion is an engine `Completion` (single turn), a multi-turn
    `Episode`, or an agent's episode (orbit/agents), which carries its agent's score; the last two
    have a `loss_mask` marking the tokens the loss must skip (tool results, user turns)."""
    scores = [
        c.score if isinstance(c, AgentEpisode) else score(task, prompt, c.output_ids)
        for c in completions
    ]
    samples = [
        Sample(
            prompt_ids=list(c.prompt_ids),
            output_ids=list(c.output_ids),
            behaviour_logprobs=list(c.logprobs),
            reward=s.reward,
            version_start=c.version_start,
            version_end=c.version_end,
            group_id=group_id,
            finish_reason=c.finish_reason,
            loss_mask=list(getattr(c, "loss_mask", None) or []),
            token_versions=list(getattr(c, "versions", None) or []),
            info={
                **s.info,
                "turns": getattr(c, "turns", 1),
                "tool_results": getattr(c, "tool_results", 0),
            },
        )
        for c, s in zip(completions, scores, strict=True)
    ]
    return Group(prompt=prompt, samples=samples, id=group_id)


@dataclass(frozen=True)
class Signal:
    """The algorithm's view of a group's rewards: the task's, shaped (the overlong penalty)."""

    algorithm: AlgorithmConfig
    max_new_tokens: int

    def rewards(self, group: Group) -> list[float]:
        return rl.shaped_rewards(
            [s.reward for s in group.samples],
            [rl.call_lengths(s.loss_mask) for s in group.samples],
            self.algorithm,
            self.max_new_tokens,
        )

    def carries(self, group: Group) -> bool:
        """False for a group whose shaped rewards are all equal (advantages all zero)."""
        return rl.carries_signal(self.rewards(group))

    def set_advantages(self, groups: list[Group]) -> None:
        """Every sample's advantage, and whether the loss leaves it out (a cut completion, overlong:
        mask)."""
        advantages = rl.advantages([self.rewards(g) for g in groups], self.algorithm.advantage)
        for group, values in zip(groups, advantages, strict=True):
            left_out = rl.left_out([s.finish_reason for s in group.samples], self.algorithm)
            for sample, a, out in zip(group.samples, values, left_out, strict=True):
                sample.advantage, sample.left_out = a, out


class Screen:
    """Staged sampling's test of a prompt's `k` probe samples (`algorithm.screen`, probes.py): did
    every one reach the best shaped reward the run has seen? Then the policy already solves the
    prompt, and a group of it would most likely agree: dynamic sampling would drop it. Agreement on
    a failure does not count: a prompt the policy rarely solves is the one whose rare success
    teaches most. Until two different rewards were seen there is no best: nothing is screened (the
    first groups of a task the base model always fails). Used by the producer's thread alone."""

    def __init__(self, k: int, signal: Signal, min_screened: float = 0.0) -> None:
        """`min_screened` (`algorithm.screen_from`): probes run only while at least this share of
        the recent prompts were screened out (probes.py)."""
        self.k, self.signal, self.min_screened = k, signal, min_screened
        self.best, self.worst = -math.inf, math.inf

    def seen(self, group: Group) -> None:
        """A group completed: its rewards widen the range seen."""
        self._see(self.signal.rewards(group))

    def solved(self, first: Group) -> bool:
        rewards = self.signal.rewards(first)
        self._see(rewards)
        return self.best > self.worst and min(rewards) >= self.best

    def would_solve(self, group: Group) -> bool:
        """Would a probe of the same samples as this group's first `k` have screened it out?"""
        first = self.signal.rewards(group)[: self.k]
        return self.best > self.worst and min(first) >= self.best

    def _see(self, rewards: list[float]) -> None:
        self.best, self.worst = max(self.best, *rewards), min(self.worst, *rewards)
