"""The protocol buffers of the Tinker wire, read and written: a forward_backward request becomes
`Datum` records (tokens and torch tensors), its outputs and a sample's result become the messages
the `tinker` SDK decodes (tinker_pb2.py, from tinker.proto). Everything else on the wire is JSON
(app.py).

Bytes on the wire are little-endian: token ids int32, logprobs float32, a tensor in its dtype; a
forward_backward output's offsets are int64 byte offsets into the concatenated per-datum arrays.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from orbit.serve import tinker_pb2 as pb
from orbit.serve.futures import Refused


class WireError(Refused):
    """A request that cannot be read as the Tinker wire says; the message names what."""


MAX_DENSE = 2**24  # values a sparse tensor may densify to (a datum's inputs are one per token)
# target_prompt_logprobs: cells a request may send, and distinct tokens x prompt positions (SGLang
# returns the union of the tokens at every position)
MAX_SCORED = 2**20

_DTYPES = {
    pb.DTYPE_FLOAT32: torch.float32,
    pb.DTYPE_INT64: torch.int64,
    pb.DTYPE_INT32: torch.int32,
    pb.DTYPE_BFLOAT16: torch.bfloat16,
}


@dataclass(frozen=True)
class Span:
    """A run of a datum's positions that came from a sampled sequence (the SDK's provenance spans):
    positions [offset, offset + length) of that sequence's prompt (`sampled` False) or of its
    sampled tokens."""

    sampled: bool
    sequence_id: str
    offset: int
    length: int


@dataclass
class Datum:
    """One sequence to score: its tokens, and its loss inputs by name (`target_tokens`, `weights`,
    `logprobs`, `advantages`, ...), each a tensor of the shape the client sent; its provenance
    (spans tiling the tokens and the targets) when the client attached it, else None."""

    tokens: list[int]
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    input_spans: list[Span] | None = None
    target_spans: list[Span] | None = None


@dataclass
class ForwardBackward:
    """A decoded forward_backward request."""

    model_id: str
    seq_id: int
    loss_fn: str
    data: list[Datum]
    config: dict[str, float | str]
    forward_only: bool


def _ints(raw: bytes) -> list[int]:
    if len(raw) % 4:
        raise WireError(f"token bytes of length {len(raw)}: not int32 values")
    return torch.frombuffer(bytearray(raw), dtype=torch.int32).tolist() if raw else []


def _array(raw: bytes, dtype: torch.dtype, shape: list[int], what: str) -> torch.Tensor:
    size = torch.empty((), dtype=dtype).element_size()
    if len(raw) % size:
        raise WireError(f"{what}: {len(raw)} bytes is not a whole number of {dtype} values")
    flat = torch.frombuffer(bytearray(raw), dtype=dtype) if raw else torch.empty(0, dtype=dtype)
    try:
        return flat.reshape(shape) if shape else flat
    except RuntimeError:
        raise WireError(f"{what}: {flat.numel()} values do not fill the shape {shape}") from None


def tensor(message: pb.Tensor, what: str) -> torch.Tensor:
    """A Tensor message as a torch tensor (a sparse CSR one densified with zeros)."""
    if message.dtype not in _DTYPES:
        raise WireError(f"{what}: unknown dtype {message.dtype}")
    dtype, shape = _DTYPES[message.dtype], list(message.shape)
    if message.WhichOneof("encoding") != "sparse_csr":
        return _array(message.dense, dtype, shape, what)
    csr = message.sparse_csr
    if len(shape) != 2:
        raise WireError(f"{what}: a sparse tensor needs a 2-d shape, got {shape}")
    if min(shape) < 0 or shape[0] * shape[1] > MAX_DENSE:
        raise WireError(f"{what}: a sparse tensor of shape {shape} (at most {MAX_DENSE} values)")
    values = _array(csr.values, dtype, [], what)
    crow = _array(csr.crow_indices, torch.int64, [], what)
    cols = _array(csr.col_indices, torch.int64, [], what)
    try:
        # the invariants checked: unchecked, indices out of range read memory out of bounds
        dense = torch.sparse_csr_tensor(crow, cols, values, shape, check_invariants=True)
        return dense.to_dense()
    except (RuntimeError, IndexError, ValueError) as err:
        raise WireError(f"{what}: a bad sparse tensor ({str(err).splitlines()[0]})") from None


def unzstd(body: bytes, limit: int) -> bytes:
    """A zstd-compressed body, at most `limit` bytes once decompressed (no bomb fills memory)."""
    import zstandard

    try:
        reader = zstandard.ZstdDecompressor().stream_reader(body)
        out = reader.read(limit + 1)
    except zstandard.ZstdError as err:
        raise WireError(f"the body is not zstd data ({err})") from None
    if len(out) > limit:
        raise WireError(f"the body decompresses past {limit} bytes")
    return out


def forward_backward(body: bytes) -> ForwardBackward:
    """A forward_backward request's body, decoded. WireError names what is wrong."""
    try:
        message = pb.ForwardBackwardRequest.FromString(body)
    except Exception as err:  # noqa: BLE001 - protobuf's DecodeError, in one line
        raise WireError(f"not a ForwardBackwardRequest protocol buffer ({err})") from None
    data = []
    for i, d in enumerate(message.data):
        tokens: list[int] = []
        for chunk in d.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise WireError(
                    f"datum {i}: a {kind} chunk; Orbit serves text models (tokens only)"
                )
            tokens += _ints(chunk.encoded_text.tokens)
        inputs = {k: tensor(v, f"datum {i}: {k}") for k, v in d.loss_fn_inputs.items()}
        datum = Datum(tokens, inputs)
        if d.model_input_spans or d.loss_fn_input_spans:  # the SDK sends both or neither
            datum.input_spans = _spans(d.model_input_spans)
            datum.target_spans = _spans(d.loss_fn_input_spans)
        data.append(datum)
    config: dict[str, float | str] = dict(message.loss_fn_config)
    for key, value in message.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else value.number
    return ForwardBackward(
        model_id=message.model_id,
        seq_id=message.seq_id,
        loss_fn=message.loss_fn,
        data=data,
        config=config,
        forward_only=message.forward_only,
    )


def _spans(spans: Any) -> list[Span]:
    out = []
    for span in spans:
        kind = span.WhichOneof("span")
        run = getattr(span, kind) if kind else None
        if run is None:
            raise WireError("a provenance span of no kind (prompt_tokens or sampled_tokens)")
        out.append(Span(kind == "sampled_tokens", run.sequence_id, run.offset, run.length))
    return out


def forward_backward_output(logprobs: list[torch.Tensor], metrics: dict[str, float]) -> bytes:
    """The result the SDK decodes: one record of every datum's `logprobs` (float32), and the
    metrics (each key `name:reduction`)."""
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(logprobs))
    arrays = [lp.detach().to(torch.float32).contiguous().cpu() for lp in logprobs]
    offsets = [0]
    for a in arrays:
        offsets.append(offsets[-1] + a.numel() * 4)
    field_ = record.fields["logprobs"]
    field_.data = b"".join(a.numpy().tobytes() for a in arrays)
    field_.offsets = torch.tensor(offsets, dtype=torch.int64).numpy().tobytes()
    field_.dtype = pb.DTYPE_FLOAT32
    trailing = list(arrays[0].shape[1:]) if arrays else []
    field_.trailing_shape.extend(trailing)
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics)
    out.loss_fn_outputs.append(record)
    return out.SerializeToString()


@dataclass
class Sequence:
    """One sampled sequence: its tokens, their logprobs, and whether it stopped (or ran to its
    length); with `topk_sample_logprobs`, the k likeliest tokens at each of its positions."""

    tokens: list[int]
    logprobs: list[float]
    stopped: bool
    top: list[list[tuple[int, float]]] | None = None


@dataclass
class Sampled:
    """A sample request's result: its sequences, and, when asked for, its prompt's logprobs (None
    where not scored) and the top k at each position ([] where not scored)."""

    sequences: list[Sequence]
    prompt_logprobs: list[float | None] | None = None
    prompt_top: list[list[tuple[int, float]]] | None = None
    target_logprobs: list[list[float]] | None = None  # per position, as Targets.rows() asked


@dataclass(frozen=True)
class Targets:
    """A sample request's `target_prompt_logprobs`: token ids in a [len(prompt) - 1, K] tensor,
    dense or sparse CSR, cell [i, j] scored at prompt position i + 1; -1 asks for nothing. The
    answer has the request's shape and layout, 0.0 where nothing was asked."""

    shape: tuple[int, int]
    cells: tuple[tuple[int, int, int], ...]  # (row, column, token id) in row-major order
    sparse: bool

    def rows(self) -> tuple[tuple[int, ...], ...]:
        """The token ids each prompt position is scored for (what an engine is asked)."""
        rows: list[list[int]] = [[] for _ in range(self.shape[0])]
        for row, _col, token in self.cells:
            if token != -1:
                rows[row].append(token)
        return tuple(tuple(r) for r in rows)

    def answer(self, values: list[list[float]]) -> pb.Tensor:
        """The logprobs an engine gave for rows() in the request's layout."""
        taken = [iter(v) for v in values]
        flat = [0.0 if t == -1 else next(taken[r]) for r, _c, t in self.cells]
        out = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=list(self.shape))
        if not self.sparse:
            dense = torch.zeros(self.shape, dtype=torch.float32)
            for (r, c, _t), v in zip(self.cells, flat, strict=True):
                dense[r, c] = v
            out.dense = dense.numpy().tobytes()
            return out
        counts = torch.zeros(self.shape[0] + 1, dtype=torch.int64)
        for r, _c, _t in self.cells:
            counts[r + 1] += 1
        out.sparse_csr.values = torch.tensor(flat, dtype=torch.float32).numpy().tobytes()
        out.sparse_csr.crow_indices = counts.cumsum(0).numpy().tobytes()
        cols = torch.tensor([c for _r, c, _t in self.cells], dtype=torch.int64)
        out.sparse_csr.col_indices = cols.numpy().tobytes()
        return out


def targets(
    data: list[Any],
    shape: list[int] | None,
    crow: list[int] | None,
    cols: list[int] | None,
    positions: int,
    vocab: int,
) -> Targets:
    """`target_prompt_logprobs` as the SDK sends it (TensorData's fields, int64) for a prompt with
    `positions` positions after its first; WireError names what is wrong."""
    what = "target_prompt_logprobs"
    if shape is None or len(shape) != 2 or shape[0] != positions or shape[1] < 0:
        raise WireError(f"{what}: shape {shape}; it must be [len(prompt) - 1 = {positions}, K]")
    rows, width = shape
    if len(data) > MAX_SCORED:
        raise WireError(f"{what}: {len(data)} cells; at most {MAX_SCORED}")
    if any(isinstance(t, bool) or not isinstance(t, int) for t in data):
        raise WireError(f"{what}: token ids must be int64")
    bad = [t for t in data if t != -1 and not 0 <= t < vocab]
    if bad:
        raise WireError(f"{what}: token id {bad[0]} outside the vocabulary (0..{vocab - 1})")
    if crow is None:
        if len(data) != rows * width:
            raise WireError(f"{what}: {len(data)} values for shape {shape}")
        cells = [(i // width, i % width, t) for i, t in enumerate(data)] if width else []
        return _bounded(Targets((rows, width), tuple(cells), sparse=False))
    if cols is None or len(crow) != rows + 1 or len(cols) != len(data):
        raise WireError(f"{what}: sparse indices that do not fit shape {shape}")
    ok = crow[0] == 0 and crow[-1] == len(data) and all(a <= b for a, b in itertools.pairwise(crow))
    if not ok or any(not 0 <= c < width for c in cols):
        raise WireError(f"{what}: a bad sparse tensor (row pointers or column indices)")
    cells = [(r, cols[i], data[i]) for r in range(rows) for i in range(crow[r], crow[r + 1])]
    return _bounded(Targets((rows, width), tuple(cells), sparse=True))


def _bounded(found: Targets) -> Targets:
    """Targets an engine can score: SGLang scores the union of the ids at every position."""
    union = len({t for _r, _c, t in found.cells if t != -1})
    if union * found.shape[0] > MAX_SCORED:
        raise WireError(
            f"target_prompt_logprobs: {union} distinct tokens at {found.shape[0]} positions; "
            f"at most {MAX_SCORED} (tokens x positions)"
        )
    return found


NO_TOP = (0, -99999.0)  # the SDK's sentinel for a top-k entry with nothing in it


def sample_response(sampled: Sampled, targets: Targets | None = None) -> bytes:
    out = pb.SampleResponse()
    for s in sampled.sequences:
        seq = out.sequences.add()
        seq.tokens = torch.tensor(s.tokens, dtype=torch.int32).numpy().tobytes()
        seq.logprobs = torch.tensor(s.logprobs, dtype=torch.float32).numpy().tobytes()
        seq.stop_reason = pb.STOP_REASON_STOP if s.stopped else pb.STOP_REASON_LENGTH
        if s.top is not None:
            _top_into(seq.topk_sampled_logprobs, s.top)
    if sampled.prompt_logprobs is not None:
        values = [float("nan") if v is None else v for v in sampled.prompt_logprobs]
        out.prompt_logprobs = torch.tensor(values, dtype=torch.float32).numpy().tobytes()
    if sampled.prompt_top:
        _top_into(out.topk_prompt_logprobs, sampled.prompt_top)
    if targets is not None and sampled.target_logprobs is not None:
        out.target_prompt_logprobs.CopyFrom(targets.answer(sampled.target_logprobs))
    return out.SerializeToString()


def _top_into(top: pb.TopkLogprobs, rows: list[list[tuple[int, float]]]) -> None:
    """Rows of (token, logprob) as the SDK's dense [length, k] pair, padded with NO_TOP."""
    k = max((len(row) for row in rows), default=0)
    padded = [row + [NO_TOP] * (k - len(row)) for row in rows]
    ids = [t for row in padded for t, _ in row]
    top.token_ids = torch.tensor(ids, dtype=torch.int32).numpy().tobytes()
    values = [v for row in padded for _, v in row]
    top.logprobs = torch.tensor(values, dtype=torch.float32).numpy().tobytes()
    top.k, top.length = k, len(padded)
