"""What a trainer step reports: sums over micro-batches, optimizer steps and ranks, turned into
token-weighted means at the end (`StepResult`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import Tensor
from transformers import PreTrainedModel

from orbit.rl import LossStats
from orbit.rollout.sample import Sample
from orbit.train.batch import Batch
from orbit.train.ranks import Alone, Ranks


def matmul_params(model: PreTrainedModel) -> int:
    """P, the weights a token's forward multiplies by, of a causal LM (loaded, or built on the
    meta device): its decoder layers' and its output head's, without any adapter's own (LoRA's and
    OFT's matmuls are overhead to the FLOP counts, not work)."""
    layers = model.get_decoder().layers
    adapters = {
        id(p)
        for m in layers.modules()
        if isinstance(m, BaseTunerLayer)
        for name in m.adapter_layer_names
        for p in getattr(m, name).parameters()
    }
    frozen = sum(p.numel() for p in layers.parameters() if id(p) not in adapters)
    return frozen + model.get_output_embeddings().weight.numel()


@dataclass
class StepResult:
    """One optimizer step. Diffs are NaN when no token of their kind was in the batch."""

    version: int  # the trainer's version after the step
    loss: float
    grad_norm: float  # before clipping
    ratio_mean: float
    ratio_max: float
    clip_frac: float
    kl: float  # NaN unless loss.kl_coef > 0
    tokens: int  # trained-on tokens (loss_mask 1)
    samples: int
    # mean |trainer - engine| logprob, each sample under the weights that made it
    logprob_diff: float
    logprob_diff_tokens: int
    policy_drift: float  # the same mean on the stale samples
    policy_drift_tokens: int
    entropy: float = math.nan  # mean entropy of the sampling distribution over the trained tokens
    masked_frac: float = 0.0  # share of trained tokens the mask band dropped
    lr: float = 0.0  # the learning rate of the batch's last optimizer step
    optimizer_steps: int = 1
    # of the step's forwards and backwards, counted by the tokens that went through (trainer.py)
    flops: float = 0.0
    # share of the step's thread checks that found the engines idle (cores.py)
    borrowed_frac: float = 0.0
    # waiting for the shared base while other adapters of a sweep trained (shared.py)
    queue_s: float = 0.0
    # the runs of a sweep whose steps shared this one's passes over the base, it included
    # (packed.py); 1: a pass of its own
    packed: int = 1


@dataclass
class Totals:
    """Sums over micro-batches (and optimizer steps), turned into token-weighted means at the
    end."""

    loss: float = 0.0
    tokens: int = 0
    ratio_sum: float = 0.0
    ratio_max: float = -math.inf
    clipped: float = 0.0
    kl_sum: float = 0.0
    entropy_sum: float = 0.0
    masked: int = 0  # tokens the mask band dropped
    diff: list[float] = field(default_factory=lambda: [0.0, 0.0])  # fresh, stale
    diff_tokens: list[int] = field(default_factory=lambda: [0, 0])

    def add(self, loss: Tensor, stats: LossStats, abs_diff: Tensor | None, batch: Batch) -> None:
        self.loss += float(loss.detach())
        if stats.tokens:
            self.tokens += stats.tokens
            self.ratio_sum += stats.ratio_mean * stats.tokens
            self.ratio_max = max(self.ratio_max, stats.ratio_max)
            self.clipped += stats.clip_frac * stats.tokens
            self.kl_sum += stats.kl * stats.tokens
            self.entropy_sum += stats.entropy_sum
            self.masked += stats.masked
        if abs_diff is not None:
            self.add_diff(abs_diff, batch)

    def add_diff(self, abs_diff: Tensor, batch: Batch) -> None:
        """Engine against trainer on every generated token, fresh samples and stale ones apart."""
        for i, rows in enumerate((batch.fresh, ~batch.fresh)):
            mask = batch.generated & rows.unsqueeze(-1)
            self.diff[i] += float(abs_diff[mask].sum())
            self.diff_tokens[i] += int(mask.sum())

    def merge(self, other: Totals) -> None:
        """Another optimizer step's sums (its agreement, when it measured one, replaces none taken
        yet)."""
        self.loss += other.loss
        self.tokens += other.tokens
        self.ratio_sum += other.ratio_sum
        self.ratio_max = max(self.ratio_max, other.ratio_max)
        self.clipped += other.clipped
        self.kl_sum += other.kl_sum
        self.entropy_sum += other.entropy_sum
        self.masked += other.masked
        for i in (0, 1):
            self.diff[i] += other.diff[i]
            self.diff_tokens[i] += other.diff_tokens[i]

    def result(
        self,
        version: int,
        grad_norm: float,
        n_samples: int,
        n_steps: int,
        lr: float,
        epochs: int = 1,
    ) -> StepResult:
        """The batch's figures: ratios, entropy and the mask share over every token of every
        optimizer step; `loss` and `grad_norm` the means over its optimizer steps; `tokens` those of
        one pass."""
        return StepResult(
            version=version,
            loss=self.loss / n_steps,
            grad_norm=grad_norm,
            ratio_mean=mean(self.ratio_sum, self.tokens),
            ratio_max=self.ratio_max if self.tokens else math.nan,
            clip_frac=mean(self.clipped, self.tokens),
            kl=mean(self.kl_sum, self.tokens),
            tokens=self.tokens // epochs,
            samples=n_samples,
            logprob_diff=mean(self.diff[0], self.diff_tokens[0]),
            logprob_diff_tokens=self.diff_tokens[0],
            policy_drift=mean(self.diff[1], self.diff_tokens[1]),
            policy_drift_tokens=self.diff_tokens[1],
            entropy=mean(self.entropy_sum, self.tokens),
            masked_frac=mean(self.masked, self.tokens) if self.tokens else 0.0,
            lr=lr,
            optimizer_steps=n_steps,
        )

    def sum_over(self, ranks: Ranks | Alone) -> None:
        """The whole batch's sums, from every rank's share."""
        sums = torch.tensor(
            [
                self.loss,
                self.tokens,
                self.ratio_sum,
                self.clipped,
                self.kl_sum,
                self.entropy_sum,
                self.masked,
                *self.diff,
                *self.diff_tokens,
            ],
            dtype=torch.float64,
        )
        most = torch.tensor([self.ratio_max], dtype=torch.float64)
        ranks.all_reduce(sums)
        ranks.all_reduce(most, torch.distributed.ReduceOp.MAX)
        (
            self.loss,
            tokens,
            self.ratio_sum,
            self.clipped,
            self.kl_sum,
            self.entropy_sum,
            masked,
            d0,
            d1,
            t0,
            t1,
        ) = sums.tolist()
        self.tokens, self.masked, self.diff, self.diff_tokens = (
            int(tokens),
            int(masked),
            [d0, d1],
            [int(t0), int(t1)],
        )
        self.ratio_max = float(most)


def saved_rows(logprobs: dict[int, Tensor], samples: list[Sample], like: Tensor) -> Tensor:
    """The samples' saved logprob rows, as one tensor shaped as a micro-batch's `like` [N, C]."""
    out = torch.zeros_like(like)
    for row, s in enumerate(samples):
        saved = logprobs[id(s)]
        width = min(saved.shape[0], out.shape[1])
        out[row, :width] = saved[:width]
    return out


def mean(total: float, count: int) -> float:
    return total / count if count else math.nan
