"""Per-row sampling over a batch of logits, vectorised; one uniform per row from its own stream.

Each sampled row draws exactly one uniform per token from its request's torch.Generator and picks
the token by inverse CDF, so a request's tokens depend only on its seed and its own logits, never
on which other requests share the batch.

The reported logprob is that of the chosen token under the distribution it was sampled from:
log_softmax(logits / temperature), truncated to top-k/top-p and renormalised when those are set
(orbit/rl/truncation.py, the rule the trainer scores with too). Greedy rows report
log_softmax(logits) (temperature 1, untruncated).

With a real vocabulary (49k, 152k) the sampler must not cost a fraction of the forward: every pass
over a [rows, vocab] tensor counts. So one fused softmax gives the probabilities, the chosen token's
logprob is the log of its probability (no full log-softmax), and the inverse CDF runs in two levels
(block masses, then one block in float64) instead of a cumulative sum of the whole row.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from orbit.engine.base import SamplingParams
from orbit.rl.truncation import kept_sorted

BLOCK = 512  # at most this many vocabulary entries per block of the two-level inverse CDF


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> tuple[list[int], list[float]]:
    """logits [n, V] float32 -> (token per row, its logprob)."""
    temps = [p.temperature for p in params]
    if not any(temps):  # all greedy: the common evaluation path, no uniforms needed
        tokens = logits.argmax(dim=-1)
        chosen = logits.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)
        return tokens.tolist(), chosen.tolist()

    device = logits.device
    n = logits.shape[0]
    t = torch.tensor([x if x > 0 else 1.0 for x in temps], device=device)
    probs = torch.softmax(logits / t[:, None], dim=-1)
    uniforms = torch.tensor(
        [
            float(torch.rand((), generator=g, dtype=torch.float64)) if g is not None else 0.0
            for g in generators
        ],
        device=device,
    )
    # Rows that keep every token sample in vocabulary order; only truncating rows are sorted, so a
    # row's token never depends on whether a batch-mate truncates.
    tokens = inverse_cdf(probs, uniforms)
    log_mass = torch.zeros(n, device=device)  # log of the kept mass: 0 where nothing is cut
    cut = [i for i, p in enumerate(params) if p.top_p < 1.0 or p.top_k > 0]
    if cut:
        rows = torch.tensor(cut, device=device)
        sorted_probs, order = probs[rows].sort(dim=-1, descending=True)
        top_k = torch.tensor([params[i].top_k for i in cut], device=device)
        top_p = torch.tensor([params[i].top_p for i in cut], device=device)
        kept = sorted_probs * kept_sorted(sorted_probs, top_p, top_k)
        picked = inverse_cdf(kept, uniforms[rows])
        tokens[rows] = order.gather(1, picked[:, None]).squeeze(1)
        log_mass[rows] = kept.sum(dim=-1).log()
    chosen = probs.gather(1, tokens[:, None]).squeeze(1).log() - log_mass
    greedy = [i for i, x in enumerate(temps) if x == 0]
    if greedy:  # temperature 1, untruncated: log_softmax(logits) of the argmax
        rows = torch.tensor(greedy, device=device)
        tokens[rows] = logits[rows].argmax(dim=-1)
        chosen[rows] = logits[rows].gather(1, tokens[rows, None]).squeeze(1) - torch.logsumexp(
            logits[rows], dim=-1
        )
    return tokens.tolist(), chosen.tolist()


def top_logprobs(logits: torch.Tensor, params: SamplingParams) -> list[tuple[int, float]]:
    """One position's `params.output_top` likeliest tokens and their logprobs, at the request's
    temperature (1 when greedy) before any top-k/top-p cut: what SGLang's `top_logprobs_num` gives
    for a sampled position, so the two engines answer alike."""
    t = params.temperature if params.temperature > 0 else 1.0
    logp = torch.log_softmax(logits.float() / t, dim=-1)
    top = logp.topk(min(params.output_top, logp.shape[-1]))
    return list(zip(top.indices.tolist(), top.values.tolist(), strict=True))


def gather_rows(logp: torch.Tensor, rows: tuple[tuple[int, ...], ...]) -> list[list[float]]:
    """logp [positions, V] -> for each position i, the logprobs of the tokens rows[i] lists."""
    pos = [i for i, row in enumerate(rows) for _ in row]
    ids = [t for row in rows for t in row]
    values = logp[pos, ids].tolist() if ids else []
    out, at = [], 0
    for row in rows:
        out.append(values[at : at + len(row)])
        at += len(row)
    return out


def inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index per row where the running sum of (unnormalised, non-negative) weights [n, V] first
    exceeds u·total, found in two levels: the block whose cumulative mass crosses it, then the entry
    in it. `right=True` makes a zero-weight entry unpickable: its running sum equals its
    predecessor's."""
    n, vocab = weights.shape
    size = math.gcd(vocab, BLOCK)
    # a vocabulary with no good block size (small or odd): pad it (cheap at that size)
    if size < 64:
        size = BLOCK
        weights = F.pad(weights, (0, -vocab % BLOCK))
    blocks = weights.view(n, -1, size)
    mass = blocks.sum(dim=-1).double()  # [n, blocks]
    cdf = mass.cumsum(dim=-1)
    target = uniforms.double() * cdf[:, -1]
    b = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)
    rows = torch.arange(n, device=weights.device)
    inner = blocks[rows, b].double().cumsum(dim=-1)  # [n, size]
    j = torch.searchsorted(
        inner, (target - (cdf[rows, b] - mass[rows, b]))[:, None], right=True
    ).squeeze(1)
    # rounding can put the target a hair past the block's last positive entry: take that entry
    last = (blocks[rows, b] > 0).int().cumsum(dim=-1).argmax(dim=-1)
    return (b * size + torch.minimum(j, last)).clamp_(max=vocab - 1)
