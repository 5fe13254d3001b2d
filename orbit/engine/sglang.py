"""The SGLang backend (`engine.backend: sglang`): Orbit's Engine protocol on a real `sglang.Engine`.

SGLang 0.5.23's offline engine runs its scheduler and detokenizer in subprocesses; the part in
this process is the tokenizer manager, an asyncio object. `SGLangEngine` runs the engine's event
loop forever in a thread of its own and submits every call to it as a coroutine
(`asyncio.run_coroutine_threadsafe`): the synchronous `Engine` methods are
`loop.run_until_complete(...)` and cannot overlap a running generation (docs/sglang.md §5).

Mapping (docs/design.md §4):

| protocol               | SGLang 0.5.23                                                                  |
|------------------------|--------------------------------------------------------------------------------|
| generate               | `tokenizer_manager.generate_request(GenerateReqInput(input_ids, sampling_params,|
|                        | return_logprob=True, lora_path=<the request's slot name>[, return_sampling_mask]))|
| load_adapter(slot)     | unload `orbit-slot-<slot>` if loaded, then `load_lora_adapter_from_tensors`   |
| activate(slot)         | Orbit-side: the slot name that new requests carry                              |
| pause / continue       | `tokenizer_manager.pause_generation` / `continue_generation` (not on `Engine`)  |
| flush_cache            | `tokenizer_manager.flush_cache()` (refused while requests run: retract/abort) |
| update_weights         | `begin_weight_update` + `update_weights_from_tensor` + `end_weight_update`      |
| release / resume_memory| `release_memory_occupation` / `resume_memory_occupation` when the memory       |
|                        | saver is on (CUDA + torch_memory_saver); without it they would free nothing    |

Slots are two adapter names, `orbit-slot-0` and `orbit-slot-1`. A request's slot is fixed when it
is submitted and it carries that slot's name as `lora_path` (checked on every request: a request
without its adapter would silently sample from the wrong policy). SGLang binds a request to the
adapter *instance* (its `lora_id`) when it is admitted, so a slot can only be rewritten once the
requests on it are gone: `load_adapter` holds new requests for that slot, waits until the ones
running on it finish (on the adapter they started with), unloads, loads, and lets the held ones
in. Unloading while paused would wait for paused requests forever, so a load that must unload is
refused while the engine is paused. The double-buffer push writes the inactive slot while the
active one serves, so nothing waits there. Each load gets a fresh `lora_id` and SGLang's radix
cache is keyed by it: KV computed with an older adapter is never reused, with or without a flush.

Logprobs: `Completion.logprobs[i]` is the sampled token's logprob under the distribution it was
sampled from, the trainer's too (orbit/truncation.py). Without top-k/top-p that is SGLang's
`output_token_logprobs[i]`, log(softmax(logits / temperature)) (log_softmax(logits) for greedy
requests; measured within 1.4e-6 of the trainer at T = 0.7 on the tiny model). With top-k/top-p
SGLang's `output_token_logprobs` are *untruncated*, so the request asks for
`return_sampling_mask` and the logprobs are SGLang's `output_token_sampling_logprobs`: the
truncated, renormalised distribution (measured within 3e-7 of Orbit's rule). Do not set
SGLANG_RETURN_ORIGINAL_LOGPROB: it makes SGLang return the temperature-1 distribution.

Rejected before anything reaches SGLang (EngineError, the slot keeps its adapter): unknown
tensor names, wrong shapes, non-float dtypes, NaN/Inf (shared with the embedded engine:
`slots.check_adapter`), OFT (SGLang serves LoRA only: sync.py pushes OFT as merged weights),
r > max_lora_rank, modules outside the engine's `lora_target_modules`, options SGLang would get
wrong (`adapter_format.to_sglang_lora`), token ids outside the vocabulary (they kill SGLang's
scheduler), `ignore_eos` together with `stop_token_ids` (SGLang then ignores the stop ids).

Liveness: a watchdog thread polls SGLang's subprocesses; when one dies every pending future and
every later call fails with EngineDeadError within about a second (SGLang itself leaves
`generate` hanging). `shutdown` kills only SGLang's own process tree: `Engine.shutdown()` kills
every child of the calling process (an embedded engine's, multiprocessing's resource tracker).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import signal
import threading
import time
from concurrent.futures import Future, InvalidStateError
from pathlib import Path
from types import SimpleNamespace

import torch

from orbit.engine.base import (
    ACTIVE,
    PAUSE_MODES,
    Completion,
    EngineDeadError,
    EngineError,
    EngineStats,
    FinishReason,
    PauseMode,
    SamplingParams,
    Slot,
)
from orbit.engine.embedded.model import DTYPES, ModelSpec, _eos_ids, check_tensor
from orbit.engine.embedded.process import EngineInfo
from orbit.engine.embedded.slots import check_adapter, check_slot
from orbit.engine.sglang_cpu.adapter_format import sglang_target_modules, to_sglang_lora
from orbit.engine.sglang_process import (
    ALL_TARGETS,
    INSTALL_HINT,
    SGLangOptions,
    checkpoint_shapes,
    close_zmq,
    kill_sglang,
    launch,
    proc_name,
    sigquits,
)
from orbit.truncation import truncates

__all__ = ["ALL_TARGETS", "INSTALL_HINT", "SGLangEngine", "SGLangOptions", "slot_name", "start_sglang_engine"]


def slot_name(slot: int) -> str:
    """The SGLang adapter name of a slot: requests on the slot carry it as `lora_path`."""
    return f"orbit-slot-{slot}"


_POLL_S = 0.2


def start_sglang_engine(model_path: str | Path, **options) -> SGLangEngine:
    """Start `sglang.Engine` on a Hugging Face checkpoint directory and return Orbit's client.

    Options: `SGLangOptions` (max_running, dtype, device, threads, seed, max_lora_rank,
    lora_target_modules, ...). CPU: Orbit's compatibility shims are turned on first. Raises
    EngineError when sglang is missing, EngineDeadError when its processes fail to start.
    """
    opts = SGLangOptions(**options)
    engine, loop, spec, hf_config, memory_saver, previous_sigquit = launch(model_path, opts)
    return SGLangEngine(engine, loop, Path(model_path), spec, hf_config, opts, memory_saver, previous_sigquit)

def _resolve(fut: Future, result=None, exc: BaseException | None = None) -> None:
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except InvalidStateError:
        pass  # already failed (dead engine) or cancelled by the caller


def _finish(info: object) -> tuple[FinishReason, str]:
    """(finish reason, SGLang's message). A reason Orbit does not know is an error, not an abort:
    resubmitting a request SGLang ended for an unknown cause would hide it and could loop."""
    kind = info.get("type") if isinstance(info, dict) else info
    if kind not in ("stop", "length", "abort"):
        raise EngineError(f"SGLang ended a request with a finish reason Orbit does not know: {info!r} "
                          "(known: stop, length, abort)")
    message = info.get("message") if isinstance(info, dict) else None
    return kind, str(message or "")


def _logprobs(meta_info: dict, truncated: bool, finish: str) -> list[float]:
    """The sampled tokens' logprobs under the distribution they were sampled from: with top-k/top-p,
    SGLang's sampling-mask logprobs (truncated and renormalised, `return_sampling_mask`), else its
    output logprobs (log_softmax(logits / T))."""
    if not truncated:
        return [float(lp) for lp, _tok, _txt in meta_info["output_token_logprobs"]]
    values = meta_info.get("output_token_sampling_logprobs")
    if values is None:
        if finish == "abort":  # aborted before its first token: no sampling mask was ever captured
            return [float(lp) for lp, _tok, _txt in meta_info.get("output_token_logprobs") or []]
        raise EngineError("SGLang returned no sampling-mask logprobs for a top-k/top-p request "
                          "(return_sampling_mask is needed for truncated sampling)")
    return [float(v) for v in values]


def _version_of(meta: dict, default: int) -> int:
    """The weight version SGLang stamped on the last tokens (update_weights passes Orbit's version)."""
    spans = meta.get("weight_versions") or []
    label = spans[-1].get("version") if spans and isinstance(spans[-1], dict) else meta.get("weight_version")
    try:
        return int(label)
    except (TypeError, ValueError):
        return default  # "default": no push yet


def _check_version(version: object) -> int:
    if isinstance(version, bool) or not isinstance(version, int):
        raise EngineError(f"version must be an int, got {version!r}")
    return version


def _plain_config(config: object) -> dict:
    """peft's to_dict() has enums and sets: plain JSON-like values for checks and for SGLang."""
    if not isinstance(config, dict):
        raise EngineError(f"adapter_config must be a dict (peft_config.to_dict()), got {type(config).__name__}")
    out = {}
    for key, value in config.items():
        value = getattr(value, "value", value)
        out[key] = sorted(value) if isinstance(value, set | frozenset) else value
    return out


class SGLangEngine:
    """Implements orbit.engine.base.Engine on `sglang.Engine`, plus `score` (teacher-forced logprobs)."""

    # Capabilities the push strategies read (orbit/sync.py); the embedded engine has them all.
    supports_oft_slots = False  # upstream SGLang serves LoRA only: OFT is pushed as merged weights
    loads_while_paused = False  # a load unloads the slot's old adapter, which waits for its requests
    flush_while_running = False  # flush_cache is refused while requests run (in_place pause included)

    def __init__(self, engine, loop: asyncio.AbstractEventLoop, model_path: Path, spec: ModelSpec, hf_config: dict,
                 options: SGLangOptions, memory_saver: bool, previous_sigquit) -> None:
        self._sgl = engine
        self._tm = engine.tokenizer_manager
        self._loop = loop
        self.model_path = model_path
        self.spec = spec
        self.options = options
        self.max_context = engine.server_args.context_length or options.context_length
        self._hf_config = hf_config
        self._shapes = checkpoint_shapes(model_path)
        self._dtype = DTYPES[options.dtype]
        self._targets = set(sglang_target_modules(options.lora_target_modules))
        self._memory_saver = memory_saver
        self._previous_sigquit = previous_sigquit
        self._sigquits_at_start = len(sigquits)
        watchdog = getattr(self._tm, "_subprocess_watchdog", None)
        self._processes = list(getattr(watchdog, "_processes", []) or [])  # SGLang's mp.Process children
        self._child_pids = list(engine.get_all_child_pids())
        self.info = EngineInfo(  # the same start-up facts the embedded client exposes
            pid=self._child_pids[0], model_type=spec.model_type, vocab_size=spec.vocab_size,
            max_context=self.max_context, eos_token_ids=_eos_ids(model_path, hf_config), num_layers=spec.num_layers,
            device=options.device, dtype=options.dtype,
        )

        self._lock = threading.Lock()  # guards what caller threads read: below, up to _closed
        self._active: int | None = None
        slots = options.slots
        self.num_slots = slots
        self._slot_version: list[int | None] = [None] * slots
        self._pending: dict[int, tuple[Future, concurrent.futures.Future]] = {}
        self._ids = itertools.count()
        self._dead: EngineDeadError | None = None
        self._closed = False
        # loop-thread state (touched only by coroutines on the engine's loop)
        self._slot_ready = [asyncio.Event() for _ in range(slots)]  # cleared while a slot is rewritten
        self._slot_users = [0] * slots  # requests admitted on each slot and not finished
        self._slot_held = [0] * slots  # requests waiting for their slot's rewrite to end
        self._slot_idle = [asyncio.Event() for _ in range(slots)]
        self._slot_loading = [asyncio.Lock() for _ in range(slots)]  # one load per slot at a time
        self._slot_backup: list[tuple[dict, dict] | None] = [None] * slots  # put back if SGLang refuses a load
        for e in (*self._slot_ready, *self._slot_idle):
            e.set()
        self._base_version = 0
        self._paused = False
        self._pause_t0 = 0.0
        self._inflight = 0
        self._held = 0
        self._busy_t0: float | None = None
        self._counters = {"tokens_generated": 0, "busy_s": 0.0, "paused_s": 0.0, "prefill_tokens": 0, "aborted": 0,
                          "retracted": 0, "prefix_cache_hits": 0}

        self._thread = threading.Thread(target=self._run_loop, name="orbit-sglang-loop", daemon=True)
        self._thread.start()
        self._watchdog = threading.Thread(target=self._watch, name="orbit-sglang-watchdog", daemon=True)
        self._watchdog.start()
        atexit.register(self.shutdown)

    # ---- plumbing ------------------------------------------------------------------------------

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))

    def _call(self, coro):
        """Run a coroutine on the engine's loop and wait for it; EngineDeadError if SGLang dies meanwhile."""
        if self._dead is not None:
            coro.close()
            raise EngineDeadError(str(self._dead))
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        while True:
            try:
                return fut.result(_POLL_S)
            except concurrent.futures.TimeoutError:
                if self._dead is not None:
                    fut.cancel()
                    raise EngineDeadError(str(self._dead)) from None

    def _watch(self) -> None:
        """Fail everything pending within about a second once one of SGLang's processes is gone."""
        import psutil

        procs = []
        for pid in self._child_pids:
            try:
                procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                self._die(EngineDeadError(f"SGLang process {pid} is gone"))
                return
        while not self._closed:
            time.sleep(_POLL_S)
            gone = []
            for proc in procs:
                try:
                    if proc.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                        gone.append(proc)
                except psutil.NoSuchProcess:
                    gone.append(proc)
            if self._closed:
                return
            if gone:
                names = ", ".join(f"{proc_name(p)} (pid {p.pid})" for p in gone)
                note = " after signalling a failure (SIGQUIT)" if len(sigquits) > self._sigquits_at_start else ""
                self._die(EngineDeadError(f"SGLang process {names} died{note}; the engine is dead"))
                return

    def _die(self, error: EngineDeadError) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = error
            pending, self._pending = list(self._pending.values()), {}
        for fut, task in pending:
            _resolve(fut, exc=self._dead)
            task.cancel()

    def _busy(self, delta: int) -> None:
        """Track wall time with at least one request in flight and the engine not paused (busy_s)."""
        now = time.perf_counter()
        if self._busy_t0 is not None:
            self._counters["busy_s"] += now - self._busy_t0
            self._busy_t0 = None
        self._inflight += delta
        if self._inflight > 0 and not self._paused:
            self._busy_t0 = now

    # ---- requests ------------------------------------------------------------------------------

    def _check_ids(self, ids: list, what: str) -> list[int]:
        vocab = self.spec.vocab_size
        for t in ids:  # an id outside the vocabulary kills SGLang's scheduler: refuse it here
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise EngineError(f"{what} token {t!r} is not an id in [0, {vocab})")
        return ids

    def _request(self, prompt_ids: list[int], sampling: SamplingParams,
                 slot: Slot) -> tuple[list[int], dict, int | None]:
        if not isinstance(sampling, SamplingParams):
            raise EngineError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        sampling.check()
        if sampling.ignore_eos and sampling.stop_token_ids:
            raise EngineError("SGLang 0.5.23 ignores stop_token_ids when ignore_eos is set; use one or the other")
        prompt = self._check_ids(list(prompt_ids), "prompt")
        if not prompt:
            raise EngineError("prompt_ids is empty")
        if len(prompt) >= self.max_context:
            raise EngineError(f"prompt has {len(prompt)} tokens; the engine context is {self.max_context} "
                              f"(the prompt must leave room for at least one generated token)")
        self._check_ids(list(sampling.stop_token_ids), "stop")
        if not (slot == ACTIVE or slot is None or (isinstance(slot, int) and not isinstance(slot, bool)
                                                    and 0 <= slot < self.num_slots)):
            raise EngineError(f"slot must be 'active', None or one of 0..{self.num_slots - 1}, got {slot!r}")
        params = {
            "max_new_tokens": min(sampling.max_new_tokens, self.max_context - len(prompt)),
            "temperature": sampling.temperature, "top_p": sampling.top_p, "ignore_eos": sampling.ignore_eos,
        }
        if sampling.top_k > 0:
            params["top_k"] = sampling.top_k
        elif truncates(sampling.top_p, 0) and sampling.temperature > 0:
            # return_sampling_mask needs a finite top_k: the whole vocabulary cuts nothing
            params["top_k"] = self.spec.vocab_size
        if sampling.stop_token_ids:
            params["stop_token_ids"] = list(sampling.stop_token_ids)
        if sampling.seed is not None:
            params["sampling_seed"] = sampling.seed  # honoured by SGLang only with deterministic inference
        with self._lock:
            bound = self._active if slot == ACTIVE else slot
            if bound is not None and self._slot_version[bound] is None:
                raise EngineError(f"slot {bound} is empty: load_adapter into it first")
        return prompt, params, bound  # type: ignore[return-value]

    def _submit(self, make_coro, fut: Future) -> Future:
        """Run `make_coro(key)` on the engine's loop for the caller's `fut`. However the coroutine
        ends (a reply that cannot be read, a bug, cancellation), `fut` is resolved: a caller never
        waits on a request that has left SGLang."""
        async def guarded(key: int) -> None:
            try:
                await make_coro(key)
            except asyncio.CancelledError:
                _resolve(fut, exc=self._dead or EngineDeadError("engine was shut down"))
                raise
            except Exception as e:  # noqa: BLE001 - whatever broke, the caller hears of it
                _resolve(fut, exc=e if isinstance(e, EngineError) else EngineError(
                    f"SGLang's reply could not be read: {type(e).__name__}: {e}"))
            finally:
                with self._lock:
                    self._pending.pop(key, None)
            _resolve(fut, exc=EngineError("internal error: a request ended without an answer"))  # no-op if resolved

        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(str(self._dead))
            key = next(self._ids)
            task = asyncio.run_coroutine_threadsafe(guarded(key), self._loop)
            self._pending[key] = (fut, task)
        return fut

    def _wait(self, fut: Future):
        """A request's answer, with the engine's liveness checked while waiting (never forever)."""
        while True:
            try:
                return fut.result(_POLL_S)
            except concurrent.futures.TimeoutError:
                if self._dead is not None and not fut.done():
                    raise EngineDeadError(str(self._dead)) from None

    async def _run(self, key: int, slot: int | None, fut: Future, **request) -> tuple[dict, int, float] | None:
        """One request on SGLang: wait for its slot, carry its adapter name, count it in and out."""
        try:
            lora_path = None if slot is None else slot_name(slot)
            if slot is not None:
                while not self._slot_ready[slot].is_set():  # the slot is being rewritten: wait for the new adapter
                    self._held += 1
                    self._slot_held[slot] += 1
                    try:
                        await self._slot_ready[slot].wait()
                    finally:
                        self._held -= 1
                        self._slot_held[slot] -= 1
                version = self._slot_version[slot]
                if version is None:
                    raise EngineError(f"slot {slot} is empty: its last load failed")
                self._slot_users[slot] += 1
                self._slot_idle[slot].clear()
            else:
                version = self._base_version
            # Every request on a slot carries that slot's adapter; only base-model requests carry none.
            if (slot is None) != (lora_path is None) or (slot is not None and lora_path != slot_name(slot)):
                raise EngineError(f"internal error: a request on slot {slot} would run with lora_path={lora_path!r}")
            t_start = time.time()
            self._busy(+1)
            try:
                out = await self._generate(lora_path=lora_path, **request)
            finally:
                self._busy(-1)
                if slot is not None:
                    self._slot_users[slot] -= 1
                    if self._slot_users[slot] == 0:
                        self._slot_idle[slot].set()
            return out, version, t_start
        except asyncio.CancelledError:
            raise
        except EngineError as e:
            _resolve(fut, exc=e)
        except Exception as e:  # noqa: BLE001 - SGLang's own refusals (ValueError, ...) reach the caller
            _resolve(fut, exc=self._dead or EngineError(f"SGLang refused the request: {e}"))
        return None

    async def _generate(self, **request) -> dict:
        """One `GenerateReqInput` through the tokenizer manager (what `Engine.async_generate` does,
        with the fields it does not pass, such as `return_sampling_mask`)."""
        from sglang.srt.managers.io_struct import GenerateReqInput

        return await self._tm.generate_request(GenerateReqInput(return_logprob=True, **request), None).__anext__()

    def generate(self, prompt_ids: list[int], sampling: SamplingParams, slot: Slot = ACTIVE,
                 meta: dict | None = None) -> Future[Completion]:
        """Submit one request; returns a Future at once. Bad arguments raise EngineError here.

        The future's Completion: `logprobs` as described in the module docstring; `version_start`
        is the slot's (or base) version when the request entered SGLang; `version_end` is its
        slot's version (unchanged: a slot is never rewritten under a request) or, for base
        requests, the base version SGLang stamped on its last token.
        """
        prompt, params, bound = self._request(prompt_ids, sampling, slot)
        truncated = truncates(sampling.top_p, sampling.top_k) and sampling.temperature > 0
        extra = {"return_sampling_mask": True} if truncated else {}

        async def run(key: int) -> None:
            got = await self._run(key, bound, fut, input_ids=prompt, sampling_params=params, **extra)
            if got is None:
                return
            out, version, t_start = got
            meta_info = out["meta_info"]
            output_ids = [int(t) for t in out["output_ids"]]
            finish, detail = _finish(meta_info.get("finish_reason"))
            logprobs = _logprobs(meta_info, truncated, finish)
            if len(logprobs) != len(output_ids):
                raise EngineError(f"SGLang returned {len(logprobs)} logprobs for {len(output_ids)} tokens")
            version_end = version if bound is not None else _version_of(meta_info, self._base_version)
            c = self._counters
            c["tokens_generated"] += len(output_ids)
            cached = int(meta_info.get("cached_tokens") or 0)
            c["prefill_tokens"] += max(0, int(meta_info.get("prompt_tokens") or len(prompt)) - cached)
            c["prefix_cache_hits"] += cached > 0
            c["aborted"] += finish == "abort"
            _resolve(fut, Completion(
                prompt_ids=prompt, output_ids=output_ids, logprobs=logprobs, finish_reason=finish, slot=bound,
                version_start=version, version_end=version_end, t_start=t_start, t_end=time.time(),
                meta=meta if meta is not None else {}, detail=detail,
            ))

        fut: Future = Future()
        return self._submit(run, fut)

    def score(self, prompt_ids: list[int], continuation_ids: list[int], slot: Slot = ACTIVE) -> list[float]:
        """Teacher-forced logprobs (temperature 1) of each continuation token after the prompt."""
        cont = self._check_ids(list(continuation_ids), "continuation")
        prompt, _, bound = self._request(prompt_ids, SamplingParams(max_new_tokens=1, temperature=0.0), slot)
        if not cont or len(prompt) + len(cont) >= self.max_context:
            raise EngineError(f"continuation must have 1..{self.max_context - len(prompt) - 1} tokens, got {len(cont)}")

        async def run(key: int) -> None:
            got = await self._run(key, bound, fut, input_ids=prompt + cont, logprob_start_len=len(prompt) - 1,
                                  sampling_params={"max_new_tokens": 1, "temperature": 0.0})
            if got is not None:  # the first entry is the last prompt token's (None): skip it
                _resolve(fut, [float(lp) for lp, _tok, _txt in got[0]["meta_info"]["input_token_logprobs"][1:]])

        fut: Future = Future()
        return self._wait(self._submit(run, fut))

    # ---- adapters ------------------------------------------------------------------------------

    def _prepare_adapter(self, tensors: dict[str, torch.Tensor], adapter_config: dict) -> tuple[dict, dict]:
        """Validate and convert everything: EngineError here means nothing reached SGLang."""
        if not self.options.lora:
            raise EngineError("this SGLang engine was started without LoRA (lora=False): it has no adapter slots")
        config = _plain_config(adapter_config)
        kind, found = check_adapter(tensors, config, self.spec, engine="the SGLang backend")
        if kind == "oft":
            raise EngineError("SGLang serves LoRA adapters only: an OFT adapter cannot go into a slot on this "
                              "backend (supports_oft_slots is False; Orbit pushes OFT as merged weights instead)")
        r = int(config["r"])
        if r > self.options.max_lora_rank:
            raise EngineError(f"adapter r={r} exceeds the engine's max_lora_rank={self.options.max_lora_rank}")
        modules = {module.rsplit(".", 1)[-1] for _, module in found}
        if modules - self._targets:
            raise EngineError(f"adapter targets {sorted(modules - self._targets)}, but the engine was started with "
                              f"lora_target_modules {sorted(self._targets)}")
        try:
            tensors, config = to_sglang_lora({k: v.detach() for k, v in tensors.items()}, config, self._hf_config)
        except ValueError as e:
            raise EngineError(str(e)) from None
        # fresh CPU copies: serialization moves their storage into shared memory in place
        return {k: v.detach().to("cpu", self._dtype, copy=True).contiguous() for k, v in tensors.items()}, config

    def load_adapter(self, slot: int, tensors: dict[str, torch.Tensor], adapter_config: dict, version: int) -> float:
        """Write a LoRA adapter into a slot: its name is unloaded (after the requests on it finish,
        on their adapter) and loaded again with the new tensors. The other slot keeps serving.

        Bad input raises EngineError before anything reaches SGLang; a load SGLang itself refuses
        restores the slot's previous adapter. Refused while paused if the slot holds an adapter
        (the unload would wait for paused requests forever). Returns the time the unload began."""
        slot = check_slot(slot, self.num_slots)
        _check_version(version)
        named, config = self._prepare_adapter(tensors, adapter_config)
        return self._call(self._load(slot, named, config, version))

    async def _load_named(self, name: str, tensors: dict[str, torch.Tensor], config: dict):
        from sglang.srt.managers.io_struct import LoadLoRAAdapterFromTensorsReqInput

        # Serialized here, once per load: the payload is file-descriptor handles that the receiver can
        # fetch only once (sending the same bytes twice kills SGLang's scheduler).
        payload = self._sgl._serialize_tensors_per_rank(tensors, None)
        return await self._tm.load_lora_adapter_from_tensors(LoadLoRAAdapterFromTensorsReqInput(
            lora_name=name, config_dict=config, serialized_named_tensors=payload), None)

    async def _load(self, slot: int, tensors: dict[str, torch.Tensor], config: dict, version: int) -> float:
        from sglang.srt.managers.io_struct import UnloadLoRAAdapterReqInput

        name = slot_name(slot)
        async with self._slot_loading[slot]:
            previous = self._slot_version[slot]
            if previous is not None and self._paused:
                raise EngineError(
                    f"load_adapter({slot}) while paused: replacing the adapter means unloading '{name}', which "
                    f"waits for the requests using it, and paused requests never finish. Load while generation "
                    f"runs (the requests on the slot finish first) or pause with 'abort'")
            ready = self._slot_ready[slot]
            ready.clear()  # new requests for this slot wait for the new adapter (they stay counted as held)
            try:
                while self._slot_users[slot]:  # requests on the slot finish on the adapter they started with
                    await self._slot_idle[slot].wait()
                written = time.time()
                if previous is not None:
                    res = await self._tm.unload_lora_adapter(UnloadLoRAAdapterReqInput(lora_name=name), None)
                    if not res.success:
                        raise EngineError(f"SGLang could not unload {name!r}: {res.error_message}")
                try:
                    res = await self._load_named(name, tensors, config)
                except Exception as e:  # noqa: BLE001 - treated like SGLang's own refusal
                    res = SimpleNamespace(success=False, error_message=f"{type(e).__name__}: {e}")
                if not res.success:
                    note = f" (slot {slot} is now empty)"
                    backup = self._slot_backup[slot]
                    if previous is not None and backup is not None and (await self._load_named(name, *backup)).success:
                        note = f" (slot {slot} keeps serving version {previous})"
                    else:
                        with self._lock:
                            self._slot_version[slot] = None
                        self._slot_backup[slot] = None
                    raise EngineError(f"SGLang refused the adapter for slot {slot}: {res.error_message}{note}")
                self._slot_backup[slot] = (tensors, config)
                with self._lock:
                    self._slot_version[slot] = version
                return written
            finally:
                ready.set()

    def activate(self, slot: int | None) -> None:
        """New ACTIVE requests carry this slot's adapter (None = base weights) from now on."""
        if slot is not None:
            slot = check_slot(slot, self.num_slots)
        with self._lock:
            self._check_alive()
            if slot is not None and self._slot_version[slot] is None:
                raise EngineError(f"cannot activate slot {slot}: it is empty")
            self._active = slot

    # ---- pause, flush, weights -----------------------------------------------------------------

    def pause_generation(self, mode: PauseMode = "in_place") -> None:
        if mode not in PAUSE_MODES:
            raise EngineError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._call(self._pause(mode))

    async def _pause(self, mode: str) -> None:
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        if not self._paused:
            self._paused, self._pause_t0 = True, time.perf_counter()
            self._busy(0)
        if mode == "retract":
            self._counters["retracted"] += self._inflight
        await self._tm.pause_generation(PauseGenerationReqInput(mode=mode))

    def continue_generation(self) -> None:
        self._call(self._continue())

    async def _continue(self) -> None:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        await self._tm.continue_generation(ContinueGenerationReqInput())
        if self._paused:
            self._counters["paused_s"] += time.perf_counter() - self._pause_t0
            self._paused = False
            self._busy(0)

    def flush_cache(self) -> None:
        """Drop SGLang's radix cache. SGLang refuses while requests run (also during an in_place
        pause): pause with 'retract' or 'abort' first; EngineError says so."""
        self._call(self._flush())

    async def _flush(self) -> None:
        res = await self._tm.flush_cache()
        if not res.success:
            raise EngineError("SGLang refused flush_cache: requests are running. Pause with 'retract' or 'abort' "
                              "first (never flush during an 'in_place' pause with requests running)")

    def _check_weights(self, tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        if not isinstance(tensors, dict) or not tensors:
            raise EngineError("update_weights: no tensors given")
        named = []
        for name, t in tensors.items():
            if name not in self._shapes:
                raise EngineError(f"update_weights: unknown parameter name {name!r}")
            check_tensor(f"update_weights: {name}", t, self._shapes[name])
            named.append((name, t.detach().to("cpu", self._dtype, copy=True).contiguous()))
        return named

    def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Full-weight push by HF names (any subset of the checkpoint's tensors). Validated first."""
        _check_version(version)
        payload = self._sgl._serialize_tensors_per_rank(self._check_weights(tensors), None)
        self._call(self._update(payload, version))

    async def _update(self, payload: list[bytes], version: int) -> None:
        from sglang.srt.managers.io_struct import (
            BeginWeightUpdateReqInput,
            EndWeightUpdateReqInput,
            UpdateWeightsFromTensorReqInput,
        )

        ok, msg = await self._tm.begin_weight_update(BeginWeightUpdateReqInput(), None)
        if not ok:
            raise EngineError(f"SGLang refused begin_weight_update: {msg}")
        try:
            ok, msg = (await self._tm.update_weights_from_tensor(UpdateWeightsFromTensorReqInput(
                serialized_named_tensors=payload, load_format=None, flush_cache=True, weight_version=str(version),
            ), None))[:2]
        finally:
            end_ok, end_msg = await self._tm.end_weight_update(EndWeightUpdateReqInput(), None)
        if not ok or not end_ok:
            raise EngineError(f"SGLang refused the weights: {msg if not ok else end_msg}")
        self._base_version = version

    def release_memory(self) -> None:
        """`release_memory_occupation` with the memory saver on; otherwise nothing (without it SGLang
        would flush its cache and stash the weights but free nothing: docs/sglang.md)."""
        if self._memory_saver:
            from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

            self._call(self._tm.release_memory_occupation(ReleaseMemoryOccupationReqInput(), None))
        else:
            self._check_alive()

    def resume_memory(self) -> None:
        if self._memory_saver:
            from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

            self._call(self._tm.resume_memory_occupation(ResumeMemoryOccupationReqInput(), None))
        else:
            self._check_alive()

    def stats(self) -> EngineStats:
        return self._call(self._stats())

    async def _stats(self) -> EngineStats:
        c = self._counters
        now = time.perf_counter()
        busy = c["busy_s"] + (now - self._busy_t0 if self._busy_t0 is not None else 0.0)
        paused = c["paused_s"] + (now - self._pause_t0 if self._paused else 0.0)
        with self._lock:
            active, versions = self._active, tuple(self._slot_version)
        return EngineStats(
            tokens_generated=c["tokens_generated"], busy_s=busy, paused_s=paused, running=self._inflight,
            waiting=self._held, prefix_cache_hits=c["prefix_cache_hits"], active_slot=active,
            slot_versions=versions, base_version=self._base_version, paused=self._paused,
            slot_requests=tuple(u + h for u, h in zip(self._slot_users, self._slot_held, strict=True)),
            prefill_tokens=c["prefill_tokens"], aborted=c["aborted"], retracted=c["retracted"],
        )

    # ---- lifetime ------------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        """The scheduler process (what dies when the engine dies)."""
        return self._child_pids[0]

    def shutdown(self) -> None:
        """Fail what is in flight, stop the loop, kill SGLang's own processes. Idempotent.

        Not `Engine.shutdown()`: that kills every child of this process."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.shutdown)
        self._die(EngineDeadError("engine was shut down"))
        watchdog = getattr(self._tm, "_subprocess_watchdog", None)
        if watchdog is not None:
            watchdog.stop()  # it would SIGQUIT this process when it sees the children go

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=2)

        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(cancel_all(), self._loop).result(5)
            except Exception:  # noqa: BLE001 - shutting down regardless
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        kill_sglang(self._child_pids, self._processes)
        # SGLang's ZeroMQ sockets default to an infinite linger: with a message still queued for a
        # dead peer, garbage-collecting their context would block this process forever.
        close_zmq(self._sgl, self._tm)
        self._sgl.send_to_rpc = None
        try:
            self._tm.cuda_vmm_feature_transport.shutdown()
        except Exception:  # noqa: BLE001 - optional cleanup of SGLang's own
            pass
        if not self._thread.is_alive():
            self._loop.close()
        self._watchdog.join(2)
        if self._previous_sigquit is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGQUIT, self._previous_sigquit)

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
