"""Tinker's losses, each a sum over a datum's tokens (the client normalises, through its weights or
advantages). Cross-entropy is the weighted negative log-likelihood; the RL ones are orbit/rl's
policy loss, the one owner of that math, with the ratio each names and a normaliser of 1 (a sum).
The clip bounds come from loss_fn_config's clip_low_threshold and clip_high_threshold:

| loss_fn | inputs | per token |
|---|---|---|
| cross_entropy | target_tokens, weights ([N] or [N, K]) | -w log p (-sum_k w_k log p(t_k)) |
| importance_sampling | target_tokens, logprobs, advantages | -r A, r = p / p_sampler |
| ppo | the same | -min(r A, clip(r, low, high) A); low 0.8, high 1.2 by default |
| cispo | the same | -sg(clip(r, low, high)) A log p; low 0, high 4 by default |
| gspo | the same, sequence_ratio_mask optional | -min(s_t A, clip(s_t, low, high) A), s_t below |
| dro | target_tokens, logprobs, advantages | -(A log p - beta/2 (log p - log q)^2); beta 0.05 |
| stable_reinforce | target_tokens, advantages, provenance (logprobs optional) | below |

Soft targets: cross_entropy's target_tokens and weights may be [N, K], K tokens scored at each
position (what the SDK's forward_backward_custom sends for a loss over a distribution, e.g. SDFT's
top-k distillation): the loss sums -w log p over all N x K cells and the logprobs come back [N, K].
The trainer scores each column as a sequence of its own over the shared tokens (clients.py).

gspo and dro are written here, as Tinker's loss pages define them, not through orbit/rl: their sums
run over every token of the datum, where orbit/rl's run over a response mask. GSPO is the token
variant (GSPO-token): s = exp(mean over the masked tokens of log p - log q), and each token's s_t
has s's value with its own log p's gradient (s_t = sg(s) p / sg(p)). Not on Tinker's pages, chosen
here and said in docs/tinker.md: gspo's mask, when the datum has no sequence_ratio_mask, is the
tokens with a nonzero advantage (the sampled ones; a prompt's logprobs of 0 would swamp the mean);
its clip bounds default to the GSPO paper's (1 - 3e-4, 1 + 4e-4); dro's beta defaults to 0.05, the
value on Tinker's page.

stable_reinforce: Tinker's page names what it needs (sampling with record_stability_info, each
sampled token's sequence_id in the datum's provenance, `kl_coeff`) but not its formula, so Orbit's
is its own reading, said in docs/tinker.md: REINFORCE with truncated importance sampling (Yao et
al., 2025) against the sampler's own logprobs as the service recorded them (q, not the client's
copy: orbit/serve/provenance.py puts them in `logprobs` and the sampled positions in `sampled`),
-sg(min(p / q, 2)) A log p on the sampled tokens, plus kl_coeff times orbit/rl's k3 estimate of the
KL between the trainer and the sampler on them (kl_coeff 0 by default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from orbit.rl import AlgorithmConfig, Norm, policy_loss
from orbit.serve.futures import Refused

SOFT = "cross_entropy"  # the loss that takes soft targets ([N, K]): forward_backward_custom's
LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "gspo", "dro", "stable_reinforce")
_RL_INPUTS = ("target_tokens", "logprobs", "advantages")
_NEEDS = {
    "cross_entropy": ("target_tokens", "weights"),
    **{k: _RL_INPUTS for k in LOSSES[1:-1]},
    # `sampled` and the recorded `logprobs` come from the datum's provenance (provenance.py)
    "stable_reinforce": (*_RL_INPUTS, "sampled"),
}
_OPTIONAL = {"gspo": ("sequence_ratio_mask",)}
# the ratio's clip bounds: Tinker's defaults for ppo and cispo, the GSPO paper's for gspo
_CLIPS = {"ppo": (0.8, 1.2), "cispo": (0.0, 4.0), "gspo": (1 - 3e-4, 1 + 4e-4)}
DRO_BETA = 0.05
STABLE_TRUNCATION = 2.0  # stable_reinforce's cap on the importance weight (TIS's C)
_SUM = Norm(tokens=1, sequences=1)  # token-mean over a normaliser of 1: the sum


class LossError(Refused):
    """A loss Orbit does not compute, or inputs that do not fit it; the message names which."""


def check(loss_fn: str, inputs: dict[str, Tensor], length: int, where: str) -> None:
    """Refuse, naming the datum and field, what the loss cannot use: a missing input, a length
    other than the datum's, a non-finite value."""
    if loss_fn not in LOSSES:
        raise LossError(f"loss_fn {loss_fn!r}: Orbit computes {', '.join(LOSSES)} (docs/tinker.md)")
    unused = sorted(set(inputs) - set(_NEEDS[loss_fn]) - set(_OPTIONAL.get(loss_fn, ())))
    if unused:  # never dropped in silence (per-token clip bounds among them)
        raise LossError(f"{where}: loss_fn {loss_fn} does not use loss_fn_inputs[{unused[0]!r}]")
    for name in _NEEDS[loss_fn] + tuple(n for n in _OPTIONAL.get(loss_fn, ()) if n in inputs):
        if name not in inputs:
            raise LossError(f"{where}: loss_fn {loss_fn} needs loss_fn_inputs[{name!r}]")
        t = inputs[name]
        if t.dim() == 0 or t.shape[0] != length or t.dim() > (2 if loss_fn == SOFT else 1):
            soft = f" ({SOFT} takes [{length}] or [{length}, K])" if loss_fn == SOFT else ""
            raise LossError(
                f"{where}: loss_fn_inputs[{name!r}] has shape {list(t.shape)}; the datum has "
                f"{length} tokens{soft}"
            )
        if t.dim() == 2 and t.shape[1] == 0:
            raise LossError(
                f"{where}: loss_fn_inputs[{name!r}] has shape {list(t.shape)}: no columns"
            )
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise LossError(f"{where}: loss_fn_inputs[{name!r}] is not finite")
    shapes = {name: list(inputs[name].shape) for name in _NEEDS[loss_fn]}
    if len({str(v) for v in shapes.values()}) > 1:
        raise LossError(f"{where}: loss_fn_inputs of different shapes {shapes}")


def columns(loss_fn: str, inputs: dict[str, Tensor]) -> int:
    """K for soft targets ([N, K] target_tokens and weights: K tokens scored at each position);
    0 for a datum's one target a position."""
    t = inputs["target_tokens"]
    return t.shape[1] if loss_fn == SOFT and t.dim() == 2 else 0


def column(inputs: dict[str, Tensor], k: int | None) -> dict[str, Tensor]:
    """A soft-target datum's k-th column of inputs, each [N] (None: the inputs as they are)."""
    return inputs if k is None else {name: t[:, k] for name, t in inputs.items()}


@dataclass(frozen=True)
class Settings:
    """An RL loss as a request sets it: orbit/rl's policy loss (importance_sampling, ppo, cispo), or
    gspo's ratio bounds, or dro's beta."""

    rl: AlgorithmConfig | None = None
    low: float = 0.0
    high: float = 0.0
    beta: float = 0.0


def algorithm(loss_fn: str, config: dict[str, float | str]) -> Settings:
    """An RL loss_fn's settings from the request's loss_fn_config (a key it does not take is
    refused, named)."""
    known = {"dro": ("beta",), "importance_sampling": (), "stable_reinforce": ("kl_coeff",)}.get(
        loss_fn, ("clip_low_threshold", "clip_high_threshold")
    )
    unknown = sorted(set(config) - set(known))
    if unknown:
        raise LossError(f"loss_fn_config: {unknown[0]!r} is not one {loss_fn} takes")
    if loss_fn == "stable_reinforce":
        kl = _number(config, "kl_coeff", 0.0)
        if not (math.isfinite(kl) and kl >= 0):
            raise LossError(f"loss_fn_config: kl_coeff {kl}; at least 0")
        return Settings(
            AlgorithmConfig(ratio="truncate", truncate_max=STABLE_TRUNCATION, kl_coef=kl)
        )
    if loss_fn == "importance_sampling":
        return Settings(AlgorithmConfig(ratio="importance"))
    if loss_fn == "dro":
        beta = float(config.get("beta", DRO_BETA))
        if not beta >= 0:
            raise LossError(f"loss_fn_config: beta {beta}; at least 0")
        return Settings(beta=beta)
    low, high = _CLIPS[loss_fn]
    low = float(config.get("clip_low_threshold", low))
    high = float(config.get("clip_high_threshold", high))
    if not 0.0 <= low < 1.0 < high:
        raise LossError(
            f"loss_fn_config: clip_low_threshold {low} and clip_high_threshold {high} must hold "
            "0 <= low < 1 < high"
        )
    if loss_fn == "gspo":
        return Settings(low=low, high=high)
    ratio = "clip" if loss_fn == "ppo" else "cispo"
    return Settings(
        AlgorithmConfig(ratio=ratio, clip_eps_low=max(1.0 - low, 1e-9), clip_eps_high=high - 1.0)
    )


def _number(config: dict[str, float | str], key: str, default: float) -> float:
    value = config.get(key, default)
    try:
        return float(value)
    except ValueError:
        raise LossError(f"loss_fn_config: {key} {value!r} is not a number") from None


def weighted(loss_fn: str, inputs: dict[str, Tensor]) -> list[bool]:
    """The positions whose logprob the loss has a gradient through: a weight (cross_entropy) or an
    advantage (the RL losses, each a multiple of it) other than 0; every one for dro, whose
    penalty reaches every token, and every sampled one for stable_reinforce (its KL term)."""
    if loss_fn == "dro":
        return [True] * len(inputs["advantages"])
    if loss_fn == "stable_reinforce":
        return (inputs["sampled"] != 0).tolist()
    name = "weights" if loss_fn == "cross_entropy" else "advantages"
    return (inputs[name] != 0).tolist()


def datum_loss(
    loss_fn: str, logp: Tensor, inputs: dict[str, Tensor], cfg: Settings | None
) -> Tensor:
    """The loss of one datum, a sum over its tokens: `logp` [N], the model's logprobs of its target
    tokens; `cfg`: the RL loss's (`algorithm`), None for cross_entropy."""
    if cfg is None:
        return -(logp * inputs["weights"].to(logp.dtype)).sum()
    if loss_fn == "gspo":
        return _gspo(logp, inputs, cfg)
    if loss_fn == "dro":
        q, adv = inputs["logprobs"].to(logp.dtype), inputs["advantages"].to(logp.dtype)
        return -(logp * adv - 0.5 * cfg.beta * (logp - q) ** 2).sum()
    assert cfg.rl is not None
    q = inputs["logprobs"][None]
    if loss_fn == "stable_reinforce":  # its sampled tokens, and its KL term toward the sampler
        mask, ref = inputs["sampled"] != 0, q
    else:
        mask, ref = torch.ones_like(logp, dtype=torch.bool), None
    loss, _ = policy_loss(
        logp[None], q, inputs["advantages"][None], mask[None], cfg.rl, _SUM, ref_logp=ref
    )
    return loss


def _gspo(logp: Tensor, inputs: dict[str, Tensor], cfg: Settings) -> Tensor:
    """GSPO-token (module docstring), as Tinker's page writes it."""
    q, adv = inputs["logprobs"].to(logp.dtype), inputs["advantages"].to(logp.dtype)
    mask = inputs.get("sequence_ratio_mask", inputs["advantages"]) != 0
    if not bool(mask.any()):
        return (logp * 0).sum()  # no token in the ratio: no signal
    log_ratio = (logp.detach() - q)[mask].mean()
    ratio = torch.exp(log_ratio + logp - logp.detach())
    clipped = ratio.clamp(cfg.low, cfg.high)
    return -torch.min(ratio * adv, clipped * adv).sum()
