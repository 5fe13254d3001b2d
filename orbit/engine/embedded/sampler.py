"""Per-row sampling over a batch of logits, vectorised; one uniform per row from its own stream.

Each sampled row draws exactly one uniform per token from its request's torch.Generator and picks
the token by inverse CDF, so a request's tokens depend only on its seed and its own logits, never
on which other requests share the batch.

The reported logprob is that of the chosen token under the distribution it was sampled from:
log_softmax(logits / temperature), truncated to top-k/top-p and renormalised when those are set
(orbit/truncation.py, the rule the trainer scores with too). Greedy rows report
log_softmax(logits) (temperature 1, untruncated).
"""

from __future__ import annotations

import torch

from orbit.engine.base import SamplingParams
from orbit.truncation import kept_sorted


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> tuple[list[int], list[float]]:
    """logits [n, V] float32 -> (token per row, its logprob)."""
    temps = [p.temperature for p in params]
    if not any(temps):  # all greedy: the common evaluation path, no uniforms needed
        logp = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
        return tokens.tolist(), logp.gather(1, tokens[:, None]).squeeze(1).tolist()

    device = logits.device
    n = logits.shape[0]
    t = torch.tensor([x if x > 0 else 1.0 for x in temps], device=device)
    logp = torch.log_softmax(logits / t[:, None], dim=-1)
    uniforms = torch.tensor(
        [float(torch.rand((), generator=g, dtype=torch.float64)) if g is not None else 0.0 for g in generators],
        device=device,
    )
    # Rows that keep every token sample in vocabulary order; only truncating rows are sorted, so a
    # row's token never depends on whether a batch-mate truncates.
    sampled = _inverse_cdf(logp.exp(), uniforms)
    log_mass = torch.zeros(n, device=device)  # log of the kept mass: 0 where nothing is cut
    cut = [i for i, p in enumerate(params) if p.top_p < 1.0 or p.top_k > 0]
    if cut:
        rows = torch.tensor(cut, device=device)
        sorted_logp, order = logp[rows].sort(dim=-1, descending=True)
        probs = sorted_logp.exp()
        top_k = torch.tensor([params[i].top_k for i in cut], device=device)
        top_p = torch.tensor([params[i].top_p for i in cut], device=device)
        kept = probs * kept_sorted(probs, top_p, top_k)
        picked = _inverse_cdf(kept, uniforms[rows])
        sampled[rows] = order.gather(1, picked[:, None]).squeeze(1)
        log_mass[rows] = kept.sum(dim=-1).log()
    greedy = torch.tensor([x == 0 for x in temps], device=device)
    tokens = torch.where(greedy, logits.argmax(dim=-1), sampled)
    chosen = logp.gather(1, tokens[:, None]).squeeze(1)  # greedy rows ran at temperature 1 and keep all
    return tokens.tolist(), torch.where(greedy, chosen, chosen - log_mass).tolist()


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index per row where the running sum of (unnormalised) weights first exceeds u·total.

    `right=True` makes a zero-weight entry unpickable: its running sum equals its predecessor's.
    """
    cdf = weights.double().cumsum(dim=-1)
    target = (uniforms * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=weights.shape[1] - 1)
