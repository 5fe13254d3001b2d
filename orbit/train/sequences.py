"""Scoring given sequences, as Tinker's forward does: the logprob of a given target token at every
position of each sequence (position i's target is usually token i + 1, but any target may be asked
for). The trainer's own batches (batch.py) run each prompt once for a group of samples; here every
sequence stands alone, so it is a plain padded forward, cut into micro-batches by tokens, with the
vocabulary projection a chunk at a time (batch.token_logprobs)."""

from __future__ import annotations

import torch
from torch import Tensor

from orbit.train.batch import Head, token_logprobs


def micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of the sequences, by length, cut into groups of at most `budget` padded tokens (a
    sequence longer than the budget goes alone; 0: one group)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    if budget <= 0:
        return [order] if order else []
    out: list[list[int]] = []
    for i in order:
        if out and (len(out[-1]) + 1) * lengths[i] <= budget:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def padded(rows: list[list[int]], device: torch.device) -> tuple[Tensor, Tensor]:
    """[B, T] token ids right-padded with 0, and the [B, T] mask of real positions."""
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = True
    return ids.to(device), mask.to(device)


def target_logprobs(
    decoder: torch.nn.Module, head: Head, tokens: list[list[int]], targets: list[list[int]]
) -> Tensor:
    """[B, T] log p(targets[b][i] | tokens[b][: i + 1]) at temperature 1, zero past each sequence's
    end; differentiable when grad is enabled. `decoder`: the base model's decoder stack (its last
    hidden state), `head`: the output projection."""
    device = next(decoder.parameters()).device
    ids, mask = padded(tokens, device)
    wanted, _ = padded(targets, device)
    hidden = decoder(input_ids=ids, attention_mask=mask.long()).last_hidden_state
    logp, _ = token_logprobs(hidden, head, wanted, mask, 1.0, 1.0, 0)
    return logp
