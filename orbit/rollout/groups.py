"""Turn the completions of one prompt into scored samples with group-relative advantages (GRPO)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from orbit.engine.base import SamplingParams
from orbit.rollout.sample import Sample
from orbit.tasks.base import Prompt, Task, TaskError


def group_advantages(rewards: list[float], eps: float = 1e-6) -> list[float]:
    """GRPO: (r - mean) / (std + eps) within one prompt's group (sample std, as in TRL's GRPO).

    A group whose rewards are all equal carries no signal: its advantages are exactly zero.
    """
    n = len(rewards)
    if n < 2 or all(r == rewards[0] for r in rewards):
        return [0.0] * n
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))
    return [(r - mean) / (std + eps) for r in rewards]


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


def sampling_params(rollout, stop_token_ids: tuple[int, ...]) -> SamplingParams:
    """The engine's sampling parameters for a recipe's rollout section."""
    return SamplingParams(
        max_new_tokens=rollout.max_new_tokens,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        stop_token_ids=stop_token_ids,
    )


def score(task: Task, prompt: Prompt, output_ids: list[int]):
    """`task.score`, with a failure named as the task's (TaskError)."""
    try:
        result = task.score(prompt, list(output_ids))
    except Exception as err:  # noqa: BLE001 - a failing verifier stops the run, named
        raise TaskError(f"task {getattr(task, 'name', '?')!r}: score failed on prompt {prompt.id!r}: "
                        f"{type(err).__name__}: {err}") from err
    if not hasattr(result, "reward") or not isinstance(result.reward, int | float):
        raise TaskError(f"task {getattr(task, 'name', '?')!r}: score must return a Score(reward, info), "
                        f"got {type(result).__name__}")
    return result


def build_group(task: Task, prompt: Prompt, completions: list, group_id: int) -> Group:
    """Score each completion and attach GRPO advantages computed within the group.

    A completion is an engine `Completion` (single turn) or a multi-turn `Episode`, whose
    `loss_mask` marks the injected tool tokens (0) that the loss must skip.
    """
    scores = [score(task, prompt, c.output_ids) for c in completions]
    advantages = group_advantages([s.reward for s in scores])
    samples = [
        Sample(
            prompt_ids=list(prompt.prompt_ids),
            output_ids=list(c.output_ids),
            behaviour_logprobs=list(c.logprobs),
            reward=s.reward,
            advantage=a,
            version_start=c.version_start,
            version_end=c.version_end,
            group_id=group_id,
            finish_reason=c.finish_reason,
            loss_mask=list(getattr(c, "loss_mask", None) or []),
            info={**s.info, "turns": getattr(c, "turns", 1), "tool_results": getattr(c, "tool_results", 0)},
        )
        for c, s, a in zip(completions, scores, advantages, strict=True)
    ]
    return Group(prompt=prompt, samples=samples, id=group_id)
