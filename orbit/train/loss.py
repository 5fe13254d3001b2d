"""The token-level policy-gradient loss with off-policy correction (advantages: orbit/rollout/pipeline.py).

The engine samples with slightly stale weights (async modes) and its own numerics, so every
token carries the engine's behaviour logprob. Three ways to use it (`loss.ratio`):
- truncate: policy gradient weighted by min(p_trainer / p_engine, truncate_max) (truncated IS);
- clip: PPO's clipped surrogate on ratio = p_trainer / p_engine. In overlapped modes the engine's
  policy is several versions old, so drifted tokens sit outside the clip range and lose their
  gradient;
- decoupled (AReaL's decoupled PPO): the clip is taken against the *proximal* policy, the
  trainer's own weights before this step, and the behaviour policy only sets a truncated
  importance weight min(p_prox / p_engine, truncate_max). Orbit takes one optimizer step per
  batch, so p_prox is the trainer's logprob under the same weights, detached: no extra forward.
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


def policy_loss(
    logp: Tensor,
    behaviour_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    ref_logp: Tensor | None = None,
    num_tokens: int | None = None,
    prox_logp: Tensor | None = None,
) -> tuple[Tensor, LossStats]:
    """Token-level policy loss, averaged over the masked tokens.

    logp, behaviour_logp, mask (and ref_logp, prox_logp): [B, T]; advantages: [B] (one per sample)
    or [B, T]. `prox_logp` is the proximal policy of the decoupled loss (default: logp detached).
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
    elif cfg.ratio == "clip":
        per_token, clipped = _clipped_surrogate(ratio, adv, cfg.clip_eps)
    else:  # decoupled
        prox = logp.detach() if prox_logp is None else torch.where(mask, prox_logp.to(logp.dtype), zero)
        prox_ratio = torch.exp((logp - prox).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
        behaviour_weight = torch.exp((prox - behaviour).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
        weight = behaviour_weight.clamp(max=cfg.truncate_max)
        surrogate, clip_bound = _clipped_surrogate(prox_ratio, adv, cfg.clip_eps)
        per_token = weight * surrogate
        clipped = clip_bound | (behaviour_weight > cfg.truncate_max)

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


def _clipped_surrogate(ratio: Tensor, adv: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """PPO's -min(r A, clip(r, 1-eps, 1+eps) A) per token, and where the clip binds (no gradient there)."""
    surrogate = ratio * adv
    clipped_surrogate = ratio.clamp(1.0 - eps, 1.0 + eps) * adv
    return -torch.minimum(surrogate, clipped_surrogate), (clipped_surrogate < surrogate).detach()


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
