"""What the trainer learns from: one scored completion, and a group of them for one prompt."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Sample:
    """One completion with everything the loss needs.

    `output_ids` are the tokens after the prompt; `loss_mask[i]` is 1 for tokens the model
    sampled itself (trained on) and 0 for tokens injected by the environment (tool results),
    which are context only. `behaviour_logprobs[i]` is the engine's logprob of `output_ids[i]`
    (0.0 where loss_mask is 0).
    """

    prompt_ids: list[int]
    output_ids: list[int]
    behaviour_logprobs: list[float]
    reward: float
    version_start: int
    version_end: int
    loss_mask: list[int] = field(default_factory=list)
    advantage: float = 0.0
    group_id: int = 0
    finish_reason: str = "stop"
    info: dict = field(default_factory=dict)
    # generated but not trained on (algorithm.overlong: mask of a cut completion)
    left_out: bool = False
    # the trainer's, where it measured them (the live page's diffs)
    trainer_logprobs: list[float] | None = None
    # Per output token, the adapter version that generated it (-1: not generated, or in a turn that
    # spanned a flip); empty for one turn, whose tokens are all of version_start when it spanned no
    # flip.
    token_versions: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.loss_mask:
            self.loss_mask = [1] * len(self.output_ids)
        if not (len(self.output_ids) == len(self.behaviour_logprobs) == len(self.loss_mask)):
            raise ValueError(
                "output_ids, behaviour_logprobs and loss_mask must have one entry per token"
            )

    def versions(self) -> list[int]:
        """The version of each output token, -1 where it is not known to be one version's."""
        if self.token_versions:
            return self.token_versions
        one = self.version_start if self.version_start == self.version_end else -1
        return [one if m else -1 for m in self.loss_mask]

    def staleness(self, step_version: int) -> int:
        """How many optimizer steps behind the trainer this sample's policy is (docs/design.md
        §5)."""
        return step_version - self.version_start
