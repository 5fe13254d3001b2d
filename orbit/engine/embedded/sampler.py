"""Per-row sampling over a batch of logits, vectorised; one uniform per row from its own stream.

Each sampled row draws exactly one uniform per token from its request's torch.Generator and picks
the token by inverse CDF, so a request's tokens depend only on its seed and its own logits, never
on which other requests share the batch.

The reported logprob is log_softmax(logits / temperature) of the chosen token (temperature 1 for
greedy rows), before top-k/top-p: the policy's distribution, which the trainer recomputes.
"""

from __future__ import annotations

import torch

from orbit.engine.base import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> tuple[list[int], list[float]]:
    """logits [n, V] float32 -> (token per row, its logprob)."""
    temps = [p.temperature for p in params]
    if not any(temps):  # all greedy: the common evaluation path, no uniforms needed
        logp = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
        return tokens.tolist(), logp.gather(1, tokens[:, None]).squeeze(1).tolist()

    device = logits.device
    n, vocab = logits.shape
    t = torch.tensor([x if x > 0 else 1.0 for x in temps], device=device)
    logp = torch.log_softmax(logits / t[:, None], dim=-1)
    uniforms = torch.tensor(
        [float(torch.rand((), generator=g, dtype=torch.float64)) if g is not None else 0.0 for g in generators],
        device=device,
    )
    if any(p.top_p < 1.0 or p.top_k > 0 for p in params):
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        probs = sorted_logp.exp()
        ranks = torch.arange(vocab, device=device)
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        # keep the smallest head whose mass reaches top_p: drop a token once the mass before it does
        before = probs.cumsum(dim=-1) - probs
        keep = (ranks[None, :] < top_k[:, None]) & ((before < top_p[:, None]) | (ranks[None, :] == 0))
        picked = _inverse_cdf(probs * keep, uniforms)
        sampled = order.gather(1, picked[:, None]).squeeze(1)
    else:
        sampled = _inverse_cdf(logp.exp(), uniforms)
    greedy = torch.tensor([x == 0 for x in temps], device=device)
    tokens = torch.where(greedy, logits.argmax(dim=-1), sampled)
    return tokens.tolist(), logp.gather(1, tokens[:, None]).squeeze(1).tolist()


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index per row where the running sum of (unnormalised) weights first exceeds u·total.

    `right=True` makes a zero-weight entry unpickable: its running sum equals its predecessor's.
    """
    cdf = weights.double().cumsum(dim=-1)
    target = (uniforms * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=weights.shape[1] - 1)
