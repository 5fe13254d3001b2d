"""Top-k / top-p truncation: the one rule that the engine samples with and the trainer scores with.

With `top_p < 1` or `top_k > 0` the engine samples from softmax(logits / T) restricted to a kept
set and renormalised. The probability of a sampled token under that distribution is larger than
its untruncated probability by 1 / (kept mass), which varies from position to position, so the
behaviour logprob, the trainer's logprob and the loss's gradient must all use the truncated
distribution (docs/design.md §5). The kept set, over tokens sorted by probability (descending):

    rank < top_k (when top_k > 0), and the mass of the tokens ranked before it < top_p
    (the most likely token is always kept)

i.e. the smallest head whose mass reaches top_p, cut at top_k. Truncated logprob of a kept token:
logp(token) - log(kept mass).
"""

from __future__ import annotations

import torch
from torch import Tensor

_ROWS_PER_CHUNK = 256  # rows sorted at a time: a [rows, vocab] sort, not [batch, length, vocab]


def truncates(top_p: float, top_k: int) -> bool:
    return top_p < 1.0 or top_k > 0


def kept_sorted(sorted_probs: Tensor, top_p: Tensor, top_k: Tensor) -> Tensor:
    """Which positions of descending-sorted probabilities [n, V] are kept; top_p, top_k: [n]
    (top_k <= 0: no cut)."""
    vocab = sorted_probs.shape[-1]
    ranks = torch.arange(vocab, device=sorted_probs.device)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    return (ranks[None, :] < k[:, None]) & ((before < top_p[:, None]) | (ranks[None, :] == 0))


@torch.no_grad()
def kept_threshold(logp: Tensor, top_p: float, top_k: int) -> Tensor:
    """The smallest kept logprob of each row of `logp` [..., V]: the kept set is logp >=
    threshold."""
    rows = logp.reshape(-1, logp.shape[-1])
    out = torch.empty(rows.shape[0], dtype=logp.dtype, device=logp.device)
    for start in range(0, rows.shape[0], _ROWS_PER_CHUNK):
        chunk = rows[start : start + _ROWS_PER_CHUNK]
        sorted_logp = chunk.sort(dim=-1, descending=True).values
        n = chunk.shape[0]
        keep = kept_sorted(
            sorted_logp.exp(),
            torch.full((n,), top_p, device=chunk.device),
            torch.full((n,), top_k, device=chunk.device),
        )
        last = keep.sum(dim=-1) - 1  # kept positions are a prefix of the sorted row
        out[start : start + n] = sorted_logp.gather(1, last[:, None]).squeeze(1)
    return out.view(logp.shape[:-1])


def truncated_logprobs(logp: Tensor, targets: Tensor, top_p: float, top_k: int) -> Tensor:
    """Logprob of `targets` [...] under `logp` [..., V] (log_softmax(logits / T)) truncated to the
    kept set and renormalised. Differentiable; the kept set itself is not (it is a selection).

    A target outside the kept set (the engine's and the trainer's numerics may differ at the edge)
    widens the kept set down to it, so its logprob stays finite.
    """
    picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not truncates(top_p, top_k):
        return picked
    threshold = torch.minimum(kept_threshold(logp.detach(), top_p, top_k), picked.detach())
    kept = torch.where(logp >= threshold.unsqueeze(-1), logp, torch.full_like(logp, -torch.inf))
    return picked - torch.logsumexp(kept, dim=-1)


def truncated_entropy(logp: Tensor, top_p: float, top_k: int) -> Tensor:
    """Entropy of each row of `logp` [..., V] (log_softmax(logits / T)) truncated to the kept set
    and renormalised: the entropy of the distribution the engine samples from."""
    if truncates(top_p, top_k):
        threshold = kept_threshold(logp.detach(), top_p, top_k)
        kept = torch.where(logp >= threshold.unsqueeze(-1), logp, torch.full_like(logp, -torch.inf))
        logp = kept - torch.logsumexp(kept, dim=-1, keepdim=True)
        return _entropy_dropping_zeros(logp.exp(), logp)  # -inf outside the kept set
    p = logp.exp()
    # Each row's sum of p log p as one dot product: no third [..., V] tensor, and a third of the
    # time of the elementwise form on a 49k vocabulary. A logit of -inf makes 0 x -inf: such rows
    # take the elementwise form, which drops it.
    entropy = -(p.unsqueeze(-2) @ logp.unsqueeze(-1)).squeeze(-1).squeeze(-1)
    bad = entropy.isnan()
    if bad.any():
        entropy = torch.where(bad, _entropy_dropping_zeros(p, logp), entropy)
    return entropy


def _entropy_dropping_zeros(p: Tensor, logp: Tensor) -> Tensor:
    return -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(dim=-1)
