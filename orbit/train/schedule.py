"""The learning rate over a run: a linear warm-up, then constant, linear or cosine decay to 0.

`trainer.steps` and `trainer.warmup_steps` count batches (the adapter's versions). With several
optimizer steps per batch (`algorithm.minibatches` × `algorithm.epochs`) the rate moves at every
optimizer step, at its fractional place in the run: the k-th optimizer step of n per batch stands at
k / n batches.
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def lr_factor(k: int, per_batch: int, steps: int, warmup: int, kind: str) -> float:
    """The factor of `lr` for optimizer step k (0-based) of a run of `steps` batches of `per_batch`
    each."""
    total, warm = steps * per_batch, warmup * per_batch
    if k < warm:
        return (k + 1) / warm  # never 0: the first step already learns
    if kind == "constant" or total <= warm:
        return 1.0
    progress = min((k - warm) / (total - warm), 1.0)
    if kind == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))  # cosine


def scheduler(
    optimizer: torch.optim.Optimizer, per_batch: int, steps: int, warmup: int, kind: str
) -> LambdaLR:
    """torch's LambdaLR over `lr_factor`; its state (the optimizer steps taken) goes into a
    checkpoint."""
    return LambdaLR(optimizer, lambda k: lr_factor(k, per_batch, steps, warmup, kind))
