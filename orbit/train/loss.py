"""GRPO advantages and the token-level policy-gradient loss with off-policy correction.

The engine samples with slightly stale weights (async modes) and its own numerics, so every
token carries the engine's behaviour logprob; the loss reweights by ratio = p_trainer / p_engine,
either truncated (truncated importance sampling) or PPO-clipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from orbit.config import LossConfig

# exp() of a log-ratio beyond this overflows float32 in the clip branch; real ratios never get near.
_MAX_LOG_RATIO = 20.0


@dataclass
class LossStats:
    """Over the masked tokens of one `policy_loss` call. kl is NaN when no reference was given."""

    ratio_mean: float
    ratio_max: float
    clip_frac: float  # fraction of tokens whose ratio was truncated/clipped
    kl: float  # mean k3 estimate of KL(policy || base)
    tokens: int


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


def policy_loss(
    logp: Tensor,
    behaviour_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    ref_logp: Tensor | None = None,
    num_tokens: int | None = None,
) -> tuple[Tensor, LossStats]:
    """Token-level policy loss, averaged over the masked tokens.

    logp, behaviour_logp, mask (and ref_logp): [B, T]; advantages: [B] (one per sample) or [B, T].
    Masked-out tokens (mask 0: padding, injected tool tokens) contribute nothing, not even NaN.
    `num_tokens` overrides the denominator so micro-batches add up to the whole batch's mean.
    The KL term (k3 estimator against `ref_logp`) is added only when cfg.kl_coef > 0.
    """
    mask = mask.bool()
    zero = torch.zeros_like(logp)
    # Sanitise masked slots first: where() alone still back-propagates NaN from the unused branch.
    logp = torch.where(mask, logp, zero)
    behaviour = torch.where(mask, behaviour_logp.to(logp.dtype), zero)
    adv = advantages.to(logp.dtype)
    adv = torch.where(mask, adv.unsqueeze(-1) if adv.dim() < logp.dim() else adv, zero)

    ratio = torch.exp((logp - behaviour).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    if cfg.ratio == "truncate":
        weight = ratio.detach().clamp(max=cfg.truncate_max)
        per_token = -weight * adv * logp
        clipped = ratio.detach() > cfg.truncate_max
    else:
        surrogate = ratio * adv
        clipped_surrogate = ratio.clamp(1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps) * adv
        per_token = -torch.minimum(surrogate, clipped_surrogate)
        clipped = (clipped_surrogate < surrogate).detach()  # the clip binds: no gradient from the token

    kl = None
    if ref_logp is not None:
        diff = torch.where(mask, ref_logp.to(logp.dtype), zero) - logp
        kl = torch.exp(diff) - diff - 1.0  # k3: unbiased, always >= 0
        if cfg.kl_coef > 0:
            per_token = per_token + cfg.kl_coef * kl

    count = int(mask.sum())
    denom = max(num_tokens if num_tokens is not None else count, 1)
    loss = torch.where(mask, per_token, zero).sum() / denom
    return loss, _stats(ratio.detach(), clipped, kl, mask, count)


def _stats(ratio: Tensor, clipped: Tensor, kl: Tensor | None, mask: Tensor, count: int) -> LossStats:
    if count == 0:
        return LossStats(ratio_mean=math.nan, ratio_max=math.nan, clip_frac=0.0, kl=math.nan, tokens=0)
    return LossStats(
        ratio_mean=float(ratio[mask].mean()),
        ratio_max=float(ratio[mask].max()),
        clip_frac=float(clipped[mask].float().mean()),
        kl=float(kl.detach()[mask].mean()) if kl is not None else math.nan,
        tokens=count,
    )
