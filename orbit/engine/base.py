"""The engine protocol (docs/design.md §3) and the records that cross it.

Every backend (embedded, SGLang) implements `Engine`. Calls are made from trainer-side threads:
`generate` returns a `Future` at once so a producer can keep many requests in flight, and the
control calls (`load_adapter`, `activate`, `pause_generation`, ...) block until the engine has
done them. Names follow SGLang's so the SGLang backend is a thin mapping.
"""

from __future__ import annotations

from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol

import torch

PauseMode = Literal["in_place", "retract", "abort"]
PAUSE_MODES: tuple[str, ...] = ("in_place", "retract", "abort")
FinishReason = Literal["stop", "length", "abort"]

# `slot` argument of `generate`: an adapter slot (0 .. slots - 1), None for the base model without
# any adapter, or ACTIVE for whatever slot `activate` chose last (the base model before any
# activate).
ACTIVE: Final = "active"
Slot = int | None | Literal["active"]


class EngineError(RuntimeError):
    """A request or call the engine refused (bad input). The engine keeps serving."""


class EngineDeadError(EngineError):
    """The engine process died or stopped answering."""


class EngineStartError(EngineDeadError):
    """An engine (or a server Orbit started) that did not start: nothing was trained (exit 3,
    orbit/run/ends.py)."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion. temperature 0 means greedy."""

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None  # per-request generator; None = the engine's own stream
    ignore_eos: bool = False  # True: only stop_token_ids (or max_new_tokens) end the request
    # the prompt's own logprobs (at temperature 1, under the request's weights): -1 none; 0 each
    # prompt token's; k > 0 also the k likeliest tokens at each position (Completion.prompt_*)
    prompt_logprobs: int = -1
    # row i lists tokens whose logprobs to return at prompt position i + 1, at temperature 1
    # (Completion.prompt_target_logprobs); a row may be empty
    prompt_targets: tuple[tuple[int, ...], ...] | None = None
    # k > 0: each sampled token's position also returns its k likeliest tokens, at the request's
    # temperature (1 when greedy) before any top-k/top-p cut (Completion.output_top), as SGLang's
    # `top_logprobs_num` gives them
    output_top: int = 0

    def check(self) -> None:
        """Raise EngineError naming the first value out of range."""
        if self.prompt_logprobs < -1:
            raise EngineError(f"prompt_logprobs must be >= -1, got {self.prompt_logprobs}")
        if self.output_top < 0:
            raise EngineError(f"output_top must be >= 0, got {self.output_top}")
        if self.max_new_tokens < 1:
            raise EngineError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise EngineError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise EngineError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise EngineError(f"top_k must be >= 0 (0 = off), got {self.top_k}")


@dataclass
class Completion:
    """One finished request.

    `logprobs[i]` is the log-probability of `output_ids[i]` under the distribution it was sampled
    from: log_softmax(logits / temperature), truncated to top-k/top-p and renormalised when those
    are set (orbit/rl/truncation.py); log_softmax(logits) when greedy. This is what the trainer
    recomputes, so the two can be compared token by token (`logprob_diff`).

    When `finish_reason` is "stop", `output_ids` ends with the stop token (eos or one of
    `stop_token_ids`) and `logprobs` has its logprob, as transformers' `generate` keeps it.
    """

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    slot: int | None  # the slot the request ran on (None = base weights)
    version_start: int  # version of the weights the request started with
    version_end: int  # version of the weights it finished with (same slot, or base); differs from
    # version_start only when those weights changed under it (a push while it was paused)
    t_start: float = 0.0  # time.time() when the engine admitted it
    t_end: float = 0.0  # time.time() when it finished
    meta: dict[str, Any] = field(default_factory=dict)  # caller's tag, returned unchanged
    # the engine's own word on why it finished, when it gives one (e.g. an abort's cause)
    detail: str = ""
    engine: int = 0  # which engine of the pool ran it (the pool sets it)
    # asked for (SamplingParams.prompt_logprobs >= 0): log p(prompt[i] | prompt[:i]) at temperature
    # 1, None at position 0; and with k > 0, the k likeliest (token, logprob) at each position
    prompt_logprobs: list[float | None] | None = None
    prompt_top: list[list[tuple[int, float]]] | None = None
    # asked for (SamplingParams.prompt_targets): row i the logprobs of that row's tokens
    prompt_target_logprobs: list[list[float]] | None = None
    # asked for (SamplingParams.output_top > 0): per output token, the k likeliest (token, logprob)
    output_top: list[list[tuple[int, float]]] | None = None

    @property
    def token_version(self) -> int:
        """The version every one of its tokens came from; -1 when the weights changed under it
        (which tokens came before the change is not known)."""
        return self.version_start if self.version_start == self.version_end else -1


@dataclass
class EngineStats:
    tokens_generated: int = 0
    busy_s: float = 0.0  # wall time spent computing (prefill + decode)
    paused_s: float = 0.0  # total wall time spent paused
    running: int = 0
    waiting: int = 0
    prefix_cache_entries: int = 0
    prefix_cache_hits: int = 0
    active_slot: int | None = None
    # per slot: the version it holds (None: empty)
    slot_versions: tuple[int | None, ...] = (None, None)
    slot_requests: tuple[int, ...] = (0, 0)  # per slot: requests bound to it, running or waiting
    base_version: int = 0
    paused: bool = False
    prefill_tokens: int = 0  # prompt (or retracted prompt+output) tokens run through a forward
    aborted: int = 0  # requests finished with reason "abort", all causes
    aborted_on_load: int = 0  # of those: running on a slot that load_adapter overwrote
    retracted: int = 0  # running requests whose KV was dropped (pause "retract", release_memory)
    threads: int = 0  # torch threads it computes on now (its own and any lent); 0: not known


@dataclass(frozen=True)
class EngineInfo:
    """What an engine learns at start-up about the model it serves."""

    pid: int  # the process whose death is the engine's
    model_type: str
    vocab_size: int
    max_context: int  # tokens per request, prompt included
    eos_token_ids: tuple[int, ...]
    num_layers: int
    device: str
    dtype: str


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, for the push strategies (orbit/push/phases.py) to choose by. Every
    member of a pool has the same (the pool checks)."""

    slots: int  # adapter slots (engine.slots)
    oft_slots: bool  # OFT adapters load into slots (else OFT is pushed as merged weights)
    # a slot can be overwritten under paused requests (they continue on it)
    loads_while_paused: bool
    # flush_cache works with requests running (an in_place pause included)
    flush_while_running: bool


class Engine(Protocol):
    """What the trainer side holds. All calls are thread-safe."""

    info: EngineInfo
    capabilities: Capabilities
    # how adapters reach it: "shared-memory" (the embedded engine's process), "in-process" (SGLang
    # in this process), "local" (a server on this host: Orbit's own files in /dev/shm) or "dir"
    # (engine.adapter_dir)
    adapter_transport: str

    def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        slot: Slot = ACTIVE,
        meta: dict[str, Any] | None = None,
    ) -> Future[Completion]: ...

    def load_adapter(
        self,
        slot: int,
        tensors: dict[str, torch.Tensor],
        adapter_config: dict[str, Any],
        version: int,
    ) -> float:
        """Returns the engine's wall-clock time (time.time()) at which the slot was written: later
        than the call's start by the transfer and by any wait for the requests on the slot."""
        ...

    def activate(self, slot: int | None) -> None: ...

    def pause_generation(self, mode: PauseMode = "in_place") -> None: ...

    def flush_cache(self) -> None: ...

    def continue_generation(self) -> None: ...

    def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None: ...

    def release_memory(self) -> None: ...

    def resume_memory(self) -> None: ...

    def stats(self) -> EngineStats: ...

    def lend_threads(self, n: int) -> None:
        """Compute on `n` more CPU threads from now until told 0: the trainer's, while it waits for
        a batch (orbit/train/cores.py). Never blocks. A backend whose threads are fixed once it
        has started ignores it."""
        ...

    def heartbeat(self) -> int | None:
        """A count the engine's own loop advances as it works (its turns, model layers run), read
        without waiting for that loop: it moves through a long step that answers no call. None: no
        such count (only its answers say it is alive)."""
        ...

    def shutdown(self) -> None:
        """Abort what is in flight and stop the engine's own processes (only its own).
        Idempotent."""
        ...

    def kill(self) -> None:
        """Stop a dead or hung engine at once, without asking it first."""
        ...


def resolve(fut: Future[Any], result: object = None, exc: BaseException | None = None) -> None:
    """Answer a caller's future once: a future already answered (a dead engine failed it) or
    cancelled by its caller keeps what it has."""
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except InvalidStateError:
        pass


_SUMMED = (
    "threads",
    "tokens_generated",
    "busy_s",
    "paused_s",
    "running",
    "waiting",
    "prefix_cache_entries",
    "prefix_cache_hits",
    "prefill_tokens",
    "aborted",
    "aborted_on_load",
    "retracted",
)


def summed(parts: list[EngineStats]) -> EngineStats:
    """The members' counters summed (pauses too: engine-seconds paused); slot facts of the first."""
    first = parts[0]
    total = EngineStats(
        active_slot=first.active_slot,
        slot_versions=first.slot_versions,
        slot_requests=first.slot_requests,
        base_version=first.base_version,
        paused=any(p.paused for p in parts),
    )
    for name in _SUMMED:
        setattr(total, name, sum(getattr(p, name) for p in parts))
    return total
