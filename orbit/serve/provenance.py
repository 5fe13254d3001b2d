"""Provenance, for stable_reinforce: what a sampling session records (`record_stability_info`),
and a training request's datums resolved against it.

A sampling session made with record_stability_info records each sequence it samples (its prompt,
its tokens and the sampler's logprobs of them) under the sequence_id the SDK hands back, in the
service's database, before the client sees the sequence. A training request names them through
each datum's provenance (the SDK's `Datum.with_provenance`): spans tiling the model input and the
targets, each a run of one sequence's prompt or sampled tokens. Tinker's rules, kept here: a
request names only sequences its own session sampled; a recorded sequence is kept for a day, and
each training request that uses it starts that day again.

Resolving checks every claim (the spans tile the datum; each run's tokens are the recorded ones)
and gives the loss the sampler's logprobs as recorded, so the loss never rests on the client's
copy: where the client sent `logprobs` too, the largest difference from the recorded ones is
reported in the request's metrics rather than dropped unseen.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from orbit.serve.futures import Refused
from orbit.serve.store import RecordedRow
from orbit.serve.wire import Datum, Sampled, Span

KEEP_S = 24 * 3600.0  # a recorded sequence lives a day after its last use (Tinker's rule)
DIFF_METRIC = "sampler_logprob_diff:max"  # the client's logprobs against the recorded ones


class ProvenanceError(Refused):
    """A datum's provenance that does not hold; the message names the datum, position and id."""


def sequence_ids(request_id: str, n: int) -> list[str]:
    """The sequence_ids of a sample request's `n` sequences (the SDK attaches them in order)."""
    return [f"{request_id}:{i}" for i in range(n)]


def records(
    tenant: str,
    session: str,
    prompt: list[int],
    ids: list[str],
    sampled: Sampled,
    now: float,
    base: str | None = None,
) -> list[RecordedRow]:
    """The rows recording a sample request's sequences, each under its sequence_id; `base`: the
    base model its sampling session samples."""
    return [
        RecordedRow(
            id=sid,
            tenant=tenant,
            session=session,
            prompt=list(prompt),
            tokens=list(seq.tokens),
            logprobs=torch.tensor(seq.logprobs, dtype=torch.float32).numpy().tobytes(),
            used=now,
            base=base,
        )
        for sid, seq in zip(ids, sampled.sequences, strict=True)
    ]


def check_tiling(data: list[Datum]) -> None:
    """Every datum's spans, where it has them, tile its input and its targets (any loss: the ones
    that do not use provenance still refuse a malformed one)."""
    for i, d in enumerate(data):
        if d.input_spans is None or d.target_spans is None:
            continue
        targets = d.inputs.get("target_tokens")
        fields = [("model_input", d.input_spans, len(d.tokens))]
        if targets is not None:
            # positions, also for soft targets ([N, K])
            fields.append(("target_tokens", d.target_spans, int(targets.shape[0])))
        for what, spans, length in fields:
            covered = sum(s.length for s in spans)
            if covered != length or any(s.length < 0 or s.offset < 0 for s in spans):
                raise ProvenanceError(
                    f"datum {i}: the provenance spans of {what} cover {covered} positions; it has "
                    f"{length} (spans tile the field, each of a length and offset >= 0)"
                )


# (tenant, sequence ids) -> the tenant's recorded sequences among them, by id (Store.recorded)
Lookup = Callable[[str, list[str]], dict[str, RecordedRow]]


def resolve(
    data: list[Datum],
    tenant: str,
    session: str,
    lookup: Lookup,
    on_base: Callable[[str], bool] = lambda _: True,
) -> tuple[list[Datum], float]:
    """stable_reinforce's datums: each with `logprobs` the sampler's recorded ones at its sampled
    positions (0 at prompt ones) and `sampled` 1 there; and the largest difference between the
    client's `logprobs` and the recorded ones (0 when it sent none). `on_base`: whether a base
    model (as a sampling session names it) is the training client's. ProvenanceError names what
    does not hold."""
    check_tiling(data)
    for i, d in enumerate(data):
        if d.target_spans is None or d.input_spans is None:
            raise ProvenanceError(
                f"datum {i}: loss_fn stable_reinforce needs provenance naming the sequence_id of "
                "each sampled token (Datum.with_provenance; sample with record_stability_info=True)"
            )
        for name in ("target_tokens", "advantages"):
            t = d.inputs.get(name)
            if t is None or t.dim() != 1 or t.numel() != len(d.tokens):
                raise ProvenanceError(
                    f"datum {i}: loss_fn stable_reinforce needs loss_fn_inputs[{name!r}], one "
                    f"value per token ({len(d.tokens)})"
                )
    found = lookup(tenant, sorted({s.sequence_id for d in data for s in _spans(d)}))
    resolved, diff = [], 0.0
    for i, d in enumerate(data):
        for sid in sorted({s.sequence_id for s in _spans(d)}):
            _check_owner(i, sid, found.get(sid), tenant, session)
            base = found[sid].base
            if base is not None and not on_base(base):  # its logprobs are another model's
                raise ProvenanceError(
                    f"datum {i}: sequence_id {sid!r} was sampled from another base model than "
                    "this training client's: its logprobs are not this policy's behaviour"
                )
        assert d.input_spans is not None and d.target_spans is not None
        _claims(i, "model_input", d.tokens, d.input_spans, found)
        targets = d.inputs["target_tokens"].to(torch.int64).tolist()
        q, sampled = _claims(i, "target_tokens", targets, d.target_spans, found)
        adv = d.inputs["advantages"]
        prompt_adv = (adv != 0) & ~sampled
        if bool(prompt_adv.any()):
            j = int(prompt_adv.nonzero()[0])
            raise ProvenanceError(
                f"datum {i}: advantages[{j}] is {float(adv[j]):g} on a prompt token (a "
                "PromptProvenanceSpan): stable_reinforce trains sampled tokens only"
            )
        sent = d.inputs.get("logprobs")
        if sent is not None and sent.shape == q.shape and bool(sampled.any()):
            diff = max(diff, float((sent.to(torch.float32) - q)[sampled].abs().max()))
        inputs = {**d.inputs, "logprobs": q, "sampled": sampled.to(torch.float32)}
        resolved.append(dataclasses.replace(d, inputs=inputs))
    return resolved, diff


def _spans(d: Datum) -> list[Span]:
    return [*(d.input_spans or []), *(d.target_spans or [])]


def _check_owner(i: int, sid: str, row: RecordedRow | None, tenant: str, session: str) -> None:
    if row is None or row.tenant != tenant:  # another tenant's is as good as missing
        raise ProvenanceError(
            f"datum {i}: sequence_id {sid!r}: no recorded sequence (sample with "
            "record_stability_info=True; a recorded sequence is kept a day after its last use)"
        )
    if row.session != session:
        raise ProvenanceError(
            f"datum {i}: sequence_id {sid!r} was sampled in session {row.session}, not in this "
            f"training client's ({session}): provenance works within one session"
        )


def _claims(
    i: int, what: str, tokens: list[int], spans: list[Span], found: dict[str, RecordedRow]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check that each span's positions hold the recorded tokens it names; the recorded sampler
    logprob at each position (0 where none) and whether it is a sampled token."""
    q = torch.zeros(len(tokens), dtype=torch.float32)
    sampled = torch.zeros(len(tokens), dtype=torch.bool)
    at = 0
    for span in spans:
        row = found[span.sequence_id]
        source = row.tokens if span.sampled else row.prompt
        kind = "sampled tokens" if span.sampled else "prompt"
        if span.offset + span.length > len(source):
            raise ProvenanceError(
                f"datum {i}: a span of {what} names positions {span.offset}.."
                f"{span.offset + span.length - 1} of sequence {span.sequence_id}'s {kind}; it has "
                f"{len(source)}"
            )
        for j in range(span.length):
            if tokens[at + j] != source[span.offset + j]:
                raise ProvenanceError(
                    f"datum {i}: {what}[{at + j}] is {tokens[at + j]}, but position "
                    f"{span.offset + j} of sequence {span.sequence_id}'s {kind} is "
                    f"{source[span.offset + j]}"
                )
        if span.sampled and span.length:
            recorded = torch.frombuffer(bytearray(row.logprobs), dtype=torch.float32)
            q[at : at + span.length] = recorded[span.offset : span.offset + span.length]
            sampled[at : at + span.length] = True
        at += span.length
    return q, sampled
