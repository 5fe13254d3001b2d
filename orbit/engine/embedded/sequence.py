"""One request as the engine tracks it from submission to its Completion."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from orbit.engine.base import Completion, FinishReason, SamplingParams


@dataclass(eq=False)  # identity semantics: a sequence is a live object, not a value
class Sequence:
    rid: int
    prompt_ids: list[int]
    sampling: SamplingParams
    slot: int | None  # bound at submission; None = base weights
    stop_ids: frozenset[int]  # stop_token_ids plus the model's eos unless ignore_eos
    generator: torch.Generator | None  # per-request stream (None when greedy)
    meta: dict = field(default_factory=dict)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    version_start: int | None = None  # set at first admission
    t_start: float = 0.0
    row: int = -1  # KV pool row while running, -1 otherwise

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def retracted(self) -> bool:
        """Waiting with output already produced: its KV was dropped and must be recomputed."""
        return bool(self.output_ids)

    def append(self, token: int, logprob: float, max_context: int) -> FinishReason | None:
        """Record a sampled token; return the finish reason if the request is done."""
        self.output_ids.append(token)
        self.logprobs.append(logprob)
        if token in self.stop_ids:
            return "stop"
        if len(self.output_ids) >= self.sampling.max_new_tokens or self.num_tokens >= max_context:
            return "length"  # at max_context the last token has no position left to be fed at
        return None

    def completion(self, reason: FinishReason, version_start: int, version_end: int, t_end: float) -> Completion:
        return Completion(
            prompt_ids=list(self.prompt_ids), output_ids=list(self.output_ids), logprobs=list(self.logprobs),
            finish_reason=reason, slot=self.slot,
            version_start=self.version_start if self.version_start is not None else version_start,
            version_end=version_end, t_start=self.t_start or t_end, t_end=t_end, meta=self.meta,
        )
