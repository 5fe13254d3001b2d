"""One request to SGLang and its reply, the same over either transport (in-process or HTTP).

A request is the fields of SGLang 0.5.23's `GenerateReqInput` (what `/generate` takes as JSON):
`input_ids`, `sampling_params`, `return_logprob`, `lora_path` (the request's slot name) and, for
top-k/top-p sampling, `return_sampling_mask`. Bad input is refused here with EngineError, before
anything reaches SGLang (an out-of-vocabulary id kills its scheduler).

A request for its prompt's logprobs (`SamplingParams.prompt_logprobs`) adds `logprob_start_len: 0`
(SGLang then runs the prompt from its start, not from a cached prefix) and, for the top k at each
position, `top_logprobs_num`; the reply's `input_token_logprobs` / `input_top_logprobs` are at
temperature 1, as SGLang computes them. Target tokens at each position (`prompt_targets`) go as
`token_ids_logprob`, one list for every position (their union), each row picked from the reply's
`input_token_ids_logprobs`. The sampled tokens' top k (`output_top`) shares `top_logprobs_num` with
the prompt's: the larger is asked for and each side cut to its own k.

Logprobs of the reply are the sampled tokens' under the distribution they were sampled from: without
top-k/top-p, `output_token_logprobs` (log_softmax(logits / T); log_softmax(logits) when greedy);
with them, `output_token_sampling_logprobs`, SGLang's truncated and renormalised distribution
(Orbit's own rule too: orbit/rl/truncation.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from orbit.engine.base import EngineError, FinishReason, SamplingParams, Slot
from orbit.engine.checks import check_ids, check_prompt, check_request_slot, check_scoring
from orbit.rl.truncation import truncates


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    sampling_params: dict
    slot: Slot  # as the caller gave it: an index, None (base model) or ACTIVE
    truncated: bool  # top-k/top-p: the reply's logprobs come from the sampling mask
    prompt_logprobs: int = -1  # as SamplingParams.prompt_logprobs
    prompt_targets: tuple[tuple[int, ...], ...] | None = None  # as SamplingParams.prompt_targets
    output_top: int = 0  # as SamplingParams.output_top

    def body(self, lora_path: str | None) -> dict:
        """The `GenerateReqInput` fields (JSON for `/generate`)."""
        body = {
            "input_ids": self.prompt_ids,
            "sampling_params": self.sampling_params,
            "return_logprob": True,
            "lora_path": lora_path,
        }
        if self.truncated:
            body["return_sampling_mask"] = True
        if self.prompt_logprobs >= 0 or self.prompt_targets is not None:
            body["logprob_start_len"] = 0
        top = max(self.prompt_logprobs, self.output_top)  # one k for both (read_reply cuts each)
        if top > 0:
            body["top_logprobs_num"] = top
        asked = sorted({t for row in self.prompt_targets or () for t in row})
        if asked:
            body["token_ids_logprob"] = asked
        return body

    def read(self, out: dict) -> Reply:
        """SGLang's answer to this request (read_reply)."""
        return read_reply(
            out, self.truncated, self.prompt_logprobs, self.prompt_targets, self.output_top
        )


def build_request(
    prompt_ids: list[int],
    sampling: SamplingParams,
    slot: Slot,
    vocab: int,
    max_context: int,
    num_slots: int,
) -> Request:
    """Check and translate one `generate` call; EngineError names the first problem."""
    if not isinstance(sampling, SamplingParams):
        raise EngineError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
    sampling.check()
    if sampling.ignore_eos and sampling.stop_token_ids:
        raise EngineError(
            "SGLang 0.5.23 ignores stop_token_ids when ignore_eos is set; use one or the other"
        )
    prompt = check_prompt(prompt_ids, vocab, max_context)
    check_ids(list(sampling.stop_token_ids), vocab, "stop")
    check_request_slot(slot, num_slots)
    check_scoring(sampling, prompt, vocab)
    truncated = truncates(sampling.top_p, sampling.top_k) and sampling.temperature > 0
    params: dict[str, Any] = {
        "max_new_tokens": min(sampling.max_new_tokens, max_context - len(prompt)),
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "ignore_eos": sampling.ignore_eos,
    }
    if sampling.top_k > 0:
        params["top_k"] = sampling.top_k
    elif truncated:
        # return_sampling_mask needs a finite top_k: the whole vocabulary cuts nothing
        params["top_k"] = vocab
    if sampling.stop_token_ids:
        params["stop_token_ids"] = list(sampling.stop_token_ids)
    if sampling.seed is not None:
        # SGLang honours it only with deterministic inference (a GPU's); on a CPU, Orbit's
        # shim (d) does (orbit_sglang_cpu_shims.py)
        params["sampling_seed"] = sampling.seed
    return Request(
        prompt,
        params,
        slot,
        truncated,
        sampling.prompt_logprobs,
        sampling.prompt_targets,
        sampling.output_top,
    )


@dataclass
class Reply:
    output_ids: list[int]
    logprobs: list[float]
    finish: FinishReason
    detail: str  # SGLang's message (an abort's cause)
    meta_info: dict
    prompt_logprobs: list[float | None] | None = None
    prompt_top: list[list[tuple[int, float]]] | None = None
    prompt_target_logprobs: list[list[float]] | None = None
    output_top: list[list[tuple[int, float]]] | None = None


def read_reply(
    out: dict,
    truncated: bool,
    prompt_logprobs: int = -1,
    prompt_targets: tuple[tuple[int, ...], ...] | None = None,
    output_top: int = 0,
) -> Reply:
    """SGLang's answer to one request. EngineError when it cannot be read (no meta_info, a finish
    reason Orbit does not know, logprobs that do not match the tokens)."""
    meta = out["meta_info"]
    output_ids = [int(t) for t in out["output_ids"]]
    finish, detail = finish_reason(meta.get("finish_reason"))
    logprobs = _logprobs(meta, truncated, finish)
    if len(logprobs) != len(output_ids):
        raise EngineError(f"SGLang returned {len(logprobs)} logprobs for {len(output_ids)} tokens")
    reply = Reply(output_ids, logprobs, finish, detail, meta)
    if prompt_logprobs >= 0 and finish != "abort":
        reply.prompt_logprobs = [
            None if lp is None else float(lp) for lp, _tok, _txt in meta["input_token_logprobs"]
        ]
        if prompt_logprobs:
            reply.prompt_top = [_top(row, prompt_logprobs) for row in meta["input_top_logprobs"]]
    if prompt_targets is not None and finish != "abort":
        # position 0 predicts nothing: SGLang's first row is empty (and none at all when no
        # position asked for a token)
        rows = meta.get("input_token_ids_logprobs") or []
        reply.prompt_target_logprobs = [
            _pick(rows[i + 1] if i + 1 < len(rows) else None, ids)
            for i, ids in enumerate(prompt_targets)
        ]
    if output_top and finish != "abort":
        rows = meta.get("output_top_logprobs") or []
        if len(rows) != len(output_ids):
            raise EngineError(
                f"SGLang returned {len(rows)} top-logprob rows for {len(output_ids)} tokens"
            )
        reply.output_top = [_top(row, output_top) for row in rows]
    return reply


def _top(row: list | None, k: int) -> list[tuple[int, float]]:
    """SGLang's (logprob, token, text) entries of one position, the k likeliest first."""
    return [(int(tok), float(lp)) for lp, tok, _txt in (row or [])[:k]]


def _pick(row: list | None, ids: tuple[int, ...]) -> list[float]:
    """The logprobs of `ids` out of one position's (logprob, token, text) entries."""
    found = {int(tok): float(lp) for lp, tok, _txt in (row or [])}
    missing = [t for t in ids if t not in found]
    if missing:
        raise EngineError(f"SGLang returned no logprob for target tokens {missing}")
    return [found[t] for t in ids]


def finish_reason(info: object) -> tuple[FinishReason, str]:
    """(finish reason, SGLang's message). A reason Orbit does not know is an error, not an abort:
    resubmitting a request SGLang ended for an unknown cause would hide it and could loop."""
    kind = info.get("type") if isinstance(info, dict) else info
    if kind not in ("stop", "length", "abort"):
        raise EngineError(
            f"SGLang ended a request with a finish reason Orbit does not know: {info!r} (known: "
            "stop, length, abort)"
        )
    message = info.get("message") if isinstance(info, dict) else None
    return kind, str(message or "")


def _logprobs(meta: dict, truncated: bool, finish: str) -> list[float]:
    if not truncated:
        return [float(lp) for lp, _tok, _txt in meta["output_token_logprobs"]]
    values = meta.get("output_token_sampling_logprobs")
    if values is None:
        if finish == "abort":  # aborted before its first token: no sampling mask was ever captured
            return [float(lp) for lp, _tok, _txt in meta.get("output_token_logprobs") or []]
        raise EngineError(
            "SGLang returned no sampling-mask logprobs for a top-k/top-p request "
            "(return_sampling_mask is needed for truncated sampling)"
        )
    return [float(v) for v in values]


def weight_version(meta: dict, default: int) -> int:
    """The weight version SGLang stamped on the last tokens (update_weights passes Orbit's
    version)."""
    spans = meta.get("weight_versions") or []
    label = (
        spans[-1].get("version")
        if spans and isinstance(spans[-1], dict)
        else meta.get("weight_version")
    )
    try:
        return int(label)  # type: ignore[arg-type]  # whatever SGLang stamped; not a number: below
    except (TypeError, ValueError):
        return default  # "default": no push yet
