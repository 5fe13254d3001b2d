"""Turn the completions of one prompt into scored samples with group-relative advantages."""

from __future__ import annotations

from dataclasses import dataclass

from orbit.engine.base import Completion, SamplingParams
from orbit.rollout.sample import Sample
from orbit.tasks.base import Prompt, Task
from orbit.train.loss import group_advantages


@dataclass
class Group:
    """The `group_size` scored samples of one prompt."""

    prompt: Prompt
    samples: list[Sample]

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


def build_group(task: Task, prompt: Prompt, completions: list[Completion], group_id: int) -> Group:
    """Score each completion and attach GRPO advantages computed within the group."""
    scores = [task.score(prompt, c.output_ids) for c in completions]
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
            info=s.info,
        )
        for c, s, a in zip(completions, scores, advantages, strict=True)
    ]
    return Group(prompt=prompt, samples=samples)
