"""Tinker's losses, each a sum over a datum's tokens (the client normalises, through its weights or
advantages). Cross-entropy is the weighted negative log-likelihood; the RL ones are orbit/rl's
policy loss, the one owner of that math, with the ratio each names and a normaliser of 1 (a sum).
The clip bounds come from loss_fn_config's clip_low_threshold and clip_high_threshold:

| loss_fn | inputs | per token |
|---|---|---|
| cross_entropy | target_tokens, weights | -w log p |
| importance_sampling | target_tokens, logprobs, advantages | -r A, r = p / p_sampler |
| ppo | the same | -min(r A, clip(r, low, high) A); low 0.8, high 1.2 by default |
| cispo | the same | -sg(clip(r, low, high)) A log p; low 0, high 4 by default |
"""

from __future__ import annotations

import torch
from torch import Tensor

from orbit.rl import AlgorithmConfig, Norm, policy_loss
from orbit.serve.futures import Refused

LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo")
_RL_INPUTS = ("target_tokens", "logprobs", "advantages")
_NEEDS = {"cross_entropy": ("target_tokens", "weights"), **{k: _RL_INPUTS for k in LOSSES[1:]}}
_CLIPS = {"ppo": (0.8, 1.2), "cispo": (0.0, 4.0)}  # the ratio's clip bounds, Tinker's defaults
_SUM = Norm(tokens=1, sequences=1)  # token-mean over a normaliser of 1: the sum


class LossError(Refused):
    """A loss Orbit does not compute, or inputs that do not fit it; the message names which."""


def check(loss_fn: str, inputs: dict[str, Tensor], length: int, where: str) -> None:
    """Refuse, naming the datum and field, what the loss cannot use: a missing input, a length
    other than the datum's, a non-finite value."""
    if loss_fn not in LOSSES:
        raise LossError(f"loss_fn {loss_fn!r}: Orbit computes {', '.join(LOSSES)} (docs/tinker.md)")
    for name in _NEEDS[loss_fn]:
        if name not in inputs:
            raise LossError(f"{where}: loss_fn {loss_fn} needs loss_fn_inputs[{name!r}]")
        t = inputs[name]
        if t.dim() != 1 or t.shape[0] != length:
            raise LossError(
                f"{where}: loss_fn_inputs[{name!r}] has shape {list(t.shape)}; the datum has "
                f"{length} tokens"
            )
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise LossError(f"{where}: loss_fn_inputs[{name!r}] is not finite")


def algorithm(loss_fn: str, config: dict[str, float | str]) -> AlgorithmConfig:
    """The policy loss an RL loss_fn is, its clip bounds from the request's loss_fn_config."""
    if loss_fn == "importance_sampling":
        return AlgorithmConfig(ratio="importance")
    low, high = _CLIPS[loss_fn]
    low = float(config.get("clip_low_threshold", low))
    high = float(config.get("clip_high_threshold", high))
    if not 0.0 <= low < 1.0 < high:
        raise LossError(
            f"loss_fn_config: clip_low_threshold {low} and clip_high_threshold {high} must hold "
            "0 <= low < 1 < high"
        )
    ratio = "clip" if loss_fn == "ppo" else "cispo"
    return AlgorithmConfig(ratio=ratio, clip_eps_low=max(1.0 - low, 1e-9), clip_eps_high=high - 1.0)


def weighted(loss_fn: str, inputs: dict[str, Tensor]) -> list[bool]:
    """The positions whose logprob the loss has a gradient through: a weight (cross_entropy) or an
    advantage (the RL losses, each a multiple of it) other than 0."""
    name = "weights" if loss_fn == "cross_entropy" else "advantages"
    return (inputs[name] != 0).tolist()


def datum_loss(
    loss_fn: str, logp: Tensor, inputs: dict[str, Tensor], cfg: AlgorithmConfig | None
) -> Tensor:
    """The loss of one datum, a sum over its tokens: `logp` [N], the model's logprobs of its target
    tokens; `cfg`: the RL loss's (`algorithm`), None for cross_entropy."""
    if cfg is None:
        return -(logp * inputs["weights"].to(logp.dtype)).sum()
    ones = torch.ones_like(logp, dtype=torch.bool)
    loss, _ = policy_loss(
        logp[None], inputs["logprobs"][None], inputs["advantages"][None], ones[None], cfg, _SUM
    )
    return loss
