"""Requests as the engine tracks them (`Sequence`) and continuous batching: who waits, who runs,
and which KV row each running sequence owns.

Running sequences occupy pool rows 0..n-1 in order (`running[i].row == i`). When some finish,
the last running rows move into the holes, so the batch stays a prefix of the pool and the
number of KV copies equals the number of finished sequences, not the batch size.
"""

from __future__ import annotations

from collections import deque
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
    # its prompt's logprobs and top-k (when asked for), set at its first prefill
    prompt_logprobs: list[float | None] | None = None
    prompt_top: list[list[tuple[int, float]]] | None = None
    prompt_target_logprobs: list[list[float]] | None = None
    output_top: list[list[tuple[int, float]]] = field(default_factory=list)  # when asked for

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

    def completion(
        self, reason: FinishReason, version_start: int, version_end: int, t_end: float
    ) -> Completion:
        return Completion(
            prompt_ids=list(self.prompt_ids),
            output_ids=list(self.output_ids),
            logprobs=list(self.logprobs),
            finish_reason=reason,
            slot=self.slot,
            version_start=self.version_start if self.version_start is not None else version_start,
            version_end=version_end,
            t_start=self.t_start or t_end,
            t_end=t_end,
            meta=self.meta,
            # scored for prompt_targets alone, the prompt's own logprobs were not asked for
            prompt_logprobs=self.prompt_logprobs if self.sampling.prompt_logprobs >= 0 else None,
            prompt_top=self.prompt_top,
            prompt_target_logprobs=self.prompt_target_logprobs,
            output_top=list(self.output_top) if self.sampling.output_top else None,
        )


Move = tuple[int, int, int]  # (source row, destination row, positions to copy)


class Scheduler:
    def __init__(self, max_running: int, max_prefill_tokens: int) -> None:
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence, front: bool = False) -> None:
        (self.waiting.appendleft if front else self.waiting.append)(seq)

    def admit(self, budget: int | None = None) -> list[Sequence]:
        """Move waiting sequences into free rows, FIFO, within the prefill token budget (`budget`,
        at most `max_prefill_tokens`).

        At least one is admitted whenever a row is free, so a long prompt cannot starve.
        """
        admitted: list[Sequence] = []
        budget = self.max_prefill_tokens if budget is None else min(budget, self.max_prefill_tokens)
        while self.waiting and len(self.running) < self.max_running:
            cost = self.waiting[0].num_tokens
            if admitted and cost > budget:
                break
            seq = self.waiting.popleft()
            budget -= cost
            seq.row = len(self.running)
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def remove(self, done: list[Sequence]) -> list[Move]:
        """Take finished sequences out of `running`; return the KV row moves that refill the
        holes."""
        gone = {id(s) for s in done}
        holes = sorted(s.row for s in done)
        for s in done:
            s.row = -1
        moves: list[Move] = []
        for hole in holes:
            while self.running and id(self.running[-1]) in gone:
                self.running.pop()
            if hole >= len(self.running):
                continue  # the hole was in the tail that just got trimmed
            last = self.running.pop()
            # its KV covers all but the last token
            moves.append((last.row, hole, last.num_tokens - 1))
            last.row = hole
            self.running[hole] = last
        while self.running and id(self.running[-1]) in gone:
            self.running.pop()
        return moves

    def take_running(self) -> list[Sequence]:
        """Remove every running sequence (retract/abort); rows are released."""
        out, self.running = self.running, []
        for s in out:
            s.row = -1
        return out

    def take_waiting(self) -> list[Sequence]:
        out = list(self.waiting)
        self.waiting.clear()
        return out
