"""Scoring given sequences, as Tinker's forward does: the logprob of a given target token at every
position of each sequence (position i's target is usually token i + 1, but any target may be asked
for), differentiable where the loss has weight.

Shared prefixes. A client sends whole sequences, but an RL batch is groups of samples of one prompt,
and the prompt is most of each sequence (a cookbook math_rl datum: a 34-token prompt, 8 sampled
tokens). So sequences that start alike are grouped (`prefix_groups`); the decoder runs a group's
common prefix once, keeps its keys and values, and runs each sequence's own rest on top of them, as
the trainer does for its own batches (batch.output_hidden). Gradients reach the prefix from every
sequence through those keys and values: the result is the whole-sequence forward's.

Where the loss has no weight (a prompt's positions: weight 0, advantage 0) the logprob is still
returned but the vocabulary projection runs without gradient, so its backward and its recomputation
are paid only where they count. The projection runs a chunk of positions at a time
(batch.token_logprobs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from orbit.train.batch import Head, token_logprobs
from orbit.train.packing import AdapterHead, Route, adapted, routed

# A second decoder pass (the rests) costs more than its tokens: sharing fewer is not worth it
MIN_SAVED = 8


@dataclass
class Group:
    """Sequences (by index) that run their first `shared` tokens once, together."""

    members: list[int]
    shared: int


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _cost(lengths: list[int], shared: int) -> int:
    """Decoder tokens a group costs: its prefix once and each member's rest."""
    return shared + sum(n - shared for n in lengths)


def prefix_groups(rows: list[list[int]], names: list[str] | None = None) -> list[Group]:
    """The sequences in groups that share a prefix: in sorted order, a sequence joins the group
    before it when running the group's (possibly shorter) common prefix once saves at least
    `MIN_SAVED` decoder tokens over running the sequence alone. A group of one runs whole (`shared`
    its length). With `names` (a packed pass), only sequences of one adapter share a prefix: its
    keys and values are the adapter's."""
    name = names or [""] * len(rows)
    groups: list[Group] = []
    for i in sorted(range(len(rows)), key=lambda i: (name[i], rows[i])):
        if groups and name[groups[-1].members[0]] == name[i]:
            g = groups[-1]
            lengths = [len(rows[m]) for m in g.members]
            shared = min(g.shared, _common(rows[g.members[0]], rows[i]))
            alone = _cost(lengths, g.shared) + len(rows[i])
            if _cost([*lengths, len(rows[i])], shared) + MIN_SAVED <= alone:
                g.members.append(i)
                g.shared = shared
                continue
        groups.append(Group([i], len(rows[i])))
    return groups


def micro_batches(
    rows: list[list[int]], budget: int, names: list[str] | None = None
) -> list[list[int]]:
    """The sequences (by index), their groups kept together in order, cut into micro-batches of
    at most `budget` padded decoder tokens: its prefixes (padded to the longest) and its members'
    rests (padded to the longest). A group too big for one is split, each part running the prefix;
    one sequence at least; 0: one micro-batch. `names`: each sequence's adapter in a packed pass
    (a micro-batch may hold several)."""
    out: list[list[int]] = []
    size = (0, 0, 0, 0)  # the last micro-batch's prefixes, widest prefix, members, widest rest
    for g in sorted(prefix_groups(rows, names), key=lambda g: (g.shared, len(g.members))):
        first = True  # whether g is not yet in the last micro-batch
        for m in g.members:
            rest = len(rows[m]) - g.shared
            n, p, b, r = size
            grown = (n + first, max(p, g.shared), b + 1, max(r, rest))
            if not out or (budget > 0 and grown[0] * grown[1] + grown[2] * grown[3] > budget):
                out.append([])
                grown = (1, g.shared, 1, rest)
            out[-1].append(m)
            size, first = grown, False
    return out


def _pad(rows: list[list[int]], width: int, device: torch.device) -> tuple[Tensor, Tensor]:
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids.to(device), mask.to(device)


def hidden_states(
    decoder: torch.nn.Module,
    rows: list[list[int]],
    groups: list[Group],
    route: Route | None = None,
) -> Tensor:
    """[B, T, H] the decoder's last hidden state at every position of the groups' sequences (in the
    groups' member order, right-padded): each group's prefix run once, each member's rest on its
    keys and values; with `route`, each under its own adapter."""
    device = next(decoder.parameters()).device
    width = max(g.shared for g in groups)
    prefix_ids, prefix_mask = _pad([rows[g.members[0]][: g.shared] for g in groups], width, device)
    names = route.names if route is not None else []
    with routed(route, [names[g.members[0]] for g in groups] if names else []):
        prefix = decoder(input_ids=prefix_ids, attention_mask=prefix_mask, use_cache=True)
    of = [gi for gi, g in enumerate(groups) for _ in g.members]
    shared = [g.shared for g in groups for _ in g.members]
    members = [rows[m] for g in groups for m in g.members]
    rests = [r[s:] for r, s in zip(members, shared, strict=True)]
    out = prefix.last_hidden_state[of]  # [B, P, H]: each member's copy of its prefix
    rest_width = max(len(r) for r in rests)
    if rest_width:
        cache = prefix.past_key_values
        index = torch.tensor(of, device=device)
        for layer in cache.layers:
            layer.batch_select_indices(index)
        ids, mask = _pad(rests, rest_width, device)
        positions = torch.tensor(shared, device=device)[:, None] + torch.arange(
            rest_width, device=device
        )
        with routed(route, [names[m] for g in groups for m in g.members] if names else []):
            tail = decoder(
                input_ids=ids,
                attention_mask=torch.cat([prefix_mask[index], mask], dim=1),
                position_ids=positions,
                past_key_values=cache,
                use_cache=False,
            ).last_hidden_state
        out = torch.cat([out, tail], dim=1)
    # member b's positions: its prefix (0 .. s-1 of the first part), then its rest
    order = [
        list(range(s)) + list(range(width, width + len(r)))
        for s, r in zip(shared, rests, strict=True)
    ]
    full = max(len(o) for o in order)
    take = torch.tensor([o + [o[0]] * (full - len(o)) for o in order], device=device)
    return out.gather(1, take[:, :, None].expand(-1, -1, out.shape[-1]))


def target_logprobs(
    decoder: torch.nn.Module,
    head: Head,
    rows: list[list[int]],
    targets: list[list[int]],
    weighted: list[list[bool]] | None = None,
    route: Route | None = None,
) -> Tensor:
    """[B, T] log p(targets[b][i] | rows[b][: i + 1]) at temperature 1, zero past each sequence's
    end, for the sequences in the order given. With grad enabled it is differentiable at the
    positions `weighted` marks (None: all); elsewhere the value alone. With `route` (a packed pass)
    sequence b is scored under adapter `route.names[b]`."""
    device = next(decoder.parameters()).device
    groups = prefix_groups(rows, route.names if route is not None else None)
    order = [m for g in groups for m in g.members]
    hidden = hidden_states(decoder, rows, groups, route)
    names = [route.names[m] for m in order] if route is not None else None
    width = hidden.shape[1]
    wanted, real = _pad([targets[m] for m in order], width, device)
    real = real.bool()
    if weighted is None or not torch.is_grad_enabled():
        logp = _project(hidden, head, wanted, real, names)
    else:
        graded, _ = _pad([[int(w) for w in weighted[m]] for m in order], width, device)
        graded = graded.bool() & real
        logp = _project(hidden, head, wanted, graded, names)
        with torch.no_grad():
            rest = _project(hidden.detach(), head, wanted, real & ~graded, names)
        logp = logp + rest
    back = torch.empty(len(order), dtype=torch.long, device=device)
    back[torch.tensor(order, device=device)] = torch.arange(len(order), device=device)
    return logp[back]


def _project(
    hidden: Tensor, head: Head, wanted: Tensor, scored: Tensor, names: list[str] | None
) -> Tensor:
    """token_logprobs at temperature 1; in a packed pass whose output projection is adapted, each
    adapter's rows through the projection under that adapter (packing.AdapterHead)."""
    if names is None or not adapted(head):
        return token_logprobs(hidden, head, wanted, scored, 1.0, 1.0, 0, entropy=False)[0]
    logp = torch.zeros(wanted.shape, dtype=torch.float32, device=hidden.device)
    for name in dict.fromkeys(names):
        mine = torch.tensor([n == name for n in names], device=hidden.device)[:, None]
        part, _ = token_logprobs(
            hidden, AdapterHead(head, name), wanted, scored & mine, 1.0, 1.0, 0, entropy=False
        )
        logp = logp + part
    return logp
