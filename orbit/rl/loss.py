"""The policy loss: an importance ratio, how it is used, which tokens count, and how they add up.

The engine samples with slightly stale weights (overlapped modes) and its own numerics, so every
token carries the engine's behaviour logprob, and the ratio is r = p_trainer / p_engine. `ratio`
says how it enters the loss:
- truncate: policy gradient times the weight min(r, truncate_max), its gradient stopped (truncated
  IS);
- clip: PPO's -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A); a clipped token has no gradient;
- decoupled (AReaL): the clip against the proximal policy p_prox (the trainer's before this batch's
  first optimizer step), times the weight min(p_prox / p_engine, truncate_max);
- cispo (MiniMax-M1): -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log p; no token loses its gradient;
- importance: -r A, the ratio's own gradient (r A ∇log p), untruncated: plain importance sampling.
`ratio_level: sequence` (GSPO) replaces every token's r by its sequence's geometric mean
exp(mean_t log r_t), the gradient flowing through every token of the sequence.

A `mask` band drops tokens (or sequences) whose behaviour ratio, p_prox / p_engine, leaves it: such
a token adds nothing to any term (policy, KL, entropy). A dropped or clipped token still counts in
the normaliser: the normaliser is fixed before the forward (`Norm`), so that micro-batches and ranks
add up to exactly what the whole batch gives.

Aggregation, over the trained tokens l_it of the N sequences of one optimizer step:
- token-mean: sum_it l_it / sum_i |o_i|;
- seq-mean-token-mean: 1/N sum_i (1/|o_i|) sum_t l_it;
- seq-mean-token-sum-norm: 1/N sum_i (1/L) sum_t l_it, L a constant (max_new_tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from orbit.rl.config import AlgorithmConfig

# exp() of a log-ratio beyond this overflows float32 in the clip branch; real ratios never get near.
_MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class Norm:
    """The whole optimizer step's counts, which every micro-batch's loss is divided by."""

    tokens: int  # trained tokens
    sequences: int  # samples with at least one trained token
    length: int = 1  # seq-mean-token-sum-norm's constant


@dataclass
class LossStats:
    """Over the masked tokens of one `policy_loss` call. kl is NaN when no reference was given."""

    ratio_mean: float
    ratio_max: float
    clip_frac: float  # share of tokens whose ratio was truncated or clipped
    kl: float  # mean k3 estimate of KL(policy || base)
    tokens: int
    masked: int = 0  # tokens the mask band dropped
    entropy_sum: float = 0.0  # the entropy summed over the tokens (when given)


def policy_loss(
    logp: Tensor,
    behaviour_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: AlgorithmConfig,
    norm: Norm | None = None,
    ref_logp: Tensor | None = None,
    prox_logp: Tensor | None = None,
    entropy: Tensor | None = None,
) -> tuple[Tensor, LossStats]:
    """The loss of one micro-batch. logp, behaviour_logp, mask (and ref_logp, prox_logp, entropy):
    [B, T]; advantages: [B] (one per sample) or [B, T]. `norm`: the whole step's counts (default:
    this call's). `prox_logp`: the proximal policy (default: logp detached, the policy before a
    single optimizer step). Masked-out tokens (mask 0: padding, tool tokens, left-out samples)
    contribute nothing, not even NaN."""
    mask = mask.bool()
    zero = torch.zeros_like(logp)
    # Sanitise masked slots first: where() alone still back-propagates NaN from the unused branch.
    logp = torch.where(mask, logp, zero)
    behaviour = torch.where(mask, behaviour_logp.to(logp.dtype), zero)
    prox = logp.detach() if prox_logp is None else torch.where(mask, prox_logp.to(logp.dtype), zero)
    adv = advantages.to(logp.dtype)
    adv = torch.where(mask, adv.unsqueeze(-1) if adv.dim() < logp.dim() else adv, zero)

    token_log_ratio = (logp - behaviour).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    log_ratio = (
        _per_sequence(token_log_ratio, mask) if cfg.ratio_level == "sequence" else token_log_ratio
    )
    per_token, clipped = _surrogate(cfg, logp, log_ratio, prox, behaviour, adv)

    kl = None
    if ref_logp is not None:
        diff = torch.where(mask, ref_logp.to(logp.dtype), zero) - logp
        kl = torch.exp(diff) - diff - 1.0  # k3: unbiased, always >= 0
        if cfg.kl_coef > 0:
            per_token = per_token + cfg.kl_coef * kl
    if entropy is not None and cfg.entropy_coef > 0:
        per_token = per_token - cfg.entropy_coef * torch.where(mask, entropy, zero)
    # A token the band drops leaves every term, its KL and entropy ones too: the engine sampled it
    # from a policy too far from the trainer's to learn from (verl's rejection sampling and slime's
    # reducers drop it the same way).
    kept = _in_band(cfg, prox - behaviour, mask)
    if kept is not None:
        per_token = torch.where(kept, per_token, zero)

    count = int(mask.sum())
    norm = norm or own_norm(mask, cfg.norm_length or 1)
    loss = _aggregate(torch.where(mask, per_token, zero), mask, cfg, norm)
    masked = int((mask & ~kept).sum()) if kept is not None else 0
    return loss, _stats(
        torch.exp(token_log_ratio.detach()), clipped, kl, mask, count, masked, entropy
    )


def own_norm(mask: Tensor, length: int = 1) -> Norm:
    """A batch's counts from its own mask [B, T]; `length`: seq-mean-token-sum-norm's constant."""
    mask = mask.bool()
    return Norm(tokens=int(mask.sum()), sequences=int(mask.any(dim=-1).sum()), length=length)


def _per_sequence(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """Each token's log-ratio replaced by its sequence's mean (GSPO: the geometric mean of the
    ratios)."""
    lengths = mask.sum(dim=-1, keepdim=True).clamp(min=1)
    seq = (log_ratio * mask).sum(dim=-1, keepdim=True) / lengths
    return seq.expand_as(log_ratio)


def _surrogate(
    cfg: AlgorithmConfig,
    logp: Tensor,
    log_ratio: Tensor,
    prox: Tensor,
    behaviour: Tensor,
    adv: Tensor,
) -> tuple[Tensor, Tensor]:
    """Per-token loss before masking and aggregation, and where the ratio was truncated or
    clipped."""
    ratio = torch.exp(log_ratio)
    low, high = 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high
    if cfg.ratio == "truncate":
        weight = ratio.detach().clamp(max=cfg.truncate_max)
        return -weight * adv * logp, ratio.detach() > cfg.truncate_max
    if cfg.ratio == "clip":
        return _clipped_surrogate(ratio, adv, low, high)
    if cfg.ratio == "importance":  # plain importance sampling: -r A, the gradient through r
        return -ratio * adv, torch.zeros_like(ratio, dtype=torch.bool)
    if cfg.ratio == "cispo":
        weight = ratio.detach().clamp(low, high)
        return -weight * adv * logp, (ratio.detach() < low) | (ratio.detach() > high)
    # decoupled
    prox_ratio = torch.exp((logp - prox).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    behaviour_weight = torch.exp((prox - behaviour).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    surrogate, clip_bound = _clipped_surrogate(prox_ratio, adv, low, high)
    return behaviour_weight.clamp(max=cfg.truncate_max) * surrogate, clip_bound | (
        behaviour_weight > cfg.truncate_max
    )


def _clipped_surrogate(
    ratio: Tensor, adv: Tensor, low: float, high: float
) -> tuple[Tensor, Tensor]:
    """PPO's -min(r A, clip(r, low, high) A) per token, and where the clip binds (no gradient
    there)."""
    surrogate = ratio * adv
    clipped_surrogate = ratio.clamp(low, high) * adv
    return -torch.minimum(surrogate, clipped_surrogate), (clipped_surrogate < surrogate).detach()


def _in_band(cfg: AlgorithmConfig, log_behaviour_ratio: Tensor, mask: Tensor) -> Tensor | None:
    """Where the behaviour ratio p_prox / p_engine lies inside the mask band (None: no band)."""
    if cfg.mask is None:
        return None
    log_r = log_behaviour_ratio.detach()
    if cfg.mask.level == "sequence":
        log_r = _per_sequence(log_r, mask)
    ratio = torch.exp(log_r.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    return (ratio >= cfg.mask.low) & (ratio <= cfg.mask.high)


def _aggregate(per_token: Tensor, mask: Tensor, cfg: AlgorithmConfig, norm: Norm) -> Tensor:
    """The micro-batch's share of the step's loss (per_token is 0 off the mask)."""
    if cfg.aggregation == "token-mean":
        return per_token.sum() / max(norm.tokens, 1)
    sequences = max(norm.sequences, 1)
    if cfg.aggregation == "seq-mean-token-mean":
        lengths = mask.sum(dim=-1).clamp(min=1).to(per_token.dtype)
        return (per_token.sum(dim=-1) / lengths).sum() / sequences
    return per_token.sum() / (norm.length * sequences)  # seq-mean-token-sum-norm


def _stats(
    ratio: Tensor,
    clipped: Tensor,
    kl: Tensor | None,
    mask: Tensor,
    count: int,
    masked: int,
    entropy: Tensor | None,
) -> LossStats:
    if count == 0:
        return LossStats(
            ratio_mean=math.nan, ratio_max=math.nan, clip_frac=0.0, kl=math.nan, tokens=0
        )
    return LossStats(
        ratio_mean=float(ratio[mask].mean()),
        ratio_max=float(ratio[mask].max()),
        clip_frac=float(clipped[mask].float().mean()),
        kl=float(kl.detach()[mask].mean()) if kl is not None else math.nan,
        tokens=count,
        masked=masked,
        entropy_sum=float(entropy.detach()[mask].sum()) if entropy is not None else 0.0,
    )
