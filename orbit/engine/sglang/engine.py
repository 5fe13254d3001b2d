"""Orbit's engine protocol on SGLang, over either transport (transport.py: in-process; http.py:
an SGLang server). One class for both: the slot gate (gate.py), request checks and replies
(requests.py), adapter preparation (adapters.py) and the accounting below are the same, only how a
call reaches SGLang differs.

The engine's asyncio loop runs forever in a thread of its own; every call is a coroutine submitted
to it. A watchdog polls the transport's liveness (the in-process engine's child processes, a
server's process and `/health`): once SGLang is gone every pending future and every later call
fails with EngineDeadError. Every request's future is resolved on every path (a reply that cannot
be read, a cancellation, a bug): a caller never waits on a request that has left SGLang.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import threading
import time
from concurrent.futures import Future, InvalidStateError
from pathlib import Path

import torch

from orbit.engine.base import (
    ACTIVE,
    PAUSE_MODES,
    Completion,
    EngineDeadError,
    EngineError,
    EngineStats,
    PauseMode,
    SamplingParams,
    Slot,
)
from orbit.engine.checks import ModelSpec, check_ids, check_slot, check_tensor, check_version, eos_ids
from orbit.engine.embedded.model import DTYPES
from orbit.engine.embedded.process import EngineInfo
from orbit.engine.sglang.adapters import prepare_adapter
from orbit.engine.sglang.gate import SlotGate, slot_name
from orbit.engine.sglang.process import SGLangOptions, checkpoint_shapes
from orbit.engine.sglang.requests import build_request, read_reply, read_scores, score_body, weight_version
from orbit.engine.sglang.transport import Transport
from orbit.engine.sglang_cpu.adapter_format import sglang_target_modules

_POLL_S = 0.2


def _resolve(fut: Future, result=None, exc: BaseException | None = None) -> None:
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except InvalidStateError:
        pass  # already failed (dead engine) or cancelled by the caller


class SGLangEngine:
    """Implements orbit.engine.base.Engine on SGLang, plus `score` (teacher-forced logprobs)."""

    # Capabilities the push strategies read (orbit/sync.py); the embedded engine has them all.
    supports_oft_slots = False  # upstream SGLang serves LoRA only: OFT is pushed as merged weights
    loads_while_paused = False  # a load unloads the slot's old adapter, which waits for its requests
    flush_while_running = False  # flush_cache is refused while requests run (in_place pause included)

    def __init__(self, transport: Transport, loop: asyncio.AbstractEventLoop, model_path: Path, spec: ModelSpec,
                 hf_config: dict, options: SGLangOptions, max_context: int, pid: int, label: str,
                 liveness_s: float = _POLL_S) -> None:
        self.transport = transport
        self._loop = loop
        self.model_path = model_path
        self.spec = spec
        self.options = options
        self.label = label  # "SGLang engine" or "SGLang server http://...": named in errors
        self.max_context = max_context
        self.num_slots = options.slots
        self._hf_config = hf_config
        self._shapes = checkpoint_shapes(model_path)
        self._dtype = DTYPES[options.dtype]
        self._targets = set(sglang_target_modules(options.lora_target_modules))
        self._liveness_s = liveness_s
        self.info = EngineInfo(  # the same start-up facts the embedded client exposes
            pid=pid, model_type=spec.model_type, vocab_size=spec.vocab_size, max_context=max_context,
            eos_token_ids=eos_ids(model_path, hf_config), num_layers=spec.num_layers, device=options.device,
            dtype=options.dtype, slots=options.slots,
        )
        self.gate = SlotGate(options.slots)  # loop-thread state
        self._lock = threading.Lock()  # guards what caller threads read and write below
        self._active: int | None = None
        self._pending: dict[int, tuple[Future, concurrent.futures.Future]] = {}
        self._ids = itertools.count()
        self._dead: EngineDeadError | None = None
        self._closed = False
        self._closing = threading.Event()  # wakes the watchdog at shutdown
        self._probe: concurrent.futures.Future | None = None  # the watchdog's liveness probe in flight
        self._base_version = 0
        self._paused = False
        self._pause_t0 = 0.0
        self._inflight = 0
        self._busy_t0: float | None = None
        self._counters = {"tokens_generated": 0, "busy_s": 0.0, "paused_s": 0.0, "prefill_tokens": 0, "aborted": 0,
                          "retracted": 0, "prefix_cache_hits": 0}
        self._thread = threading.Thread(target=self._run_loop, name="orbit-sglang-loop", daemon=True)
        self._thread.start()
        self._watchdog = threading.Thread(target=self._watch, name="orbit-sglang-watchdog", daemon=True)
        self._watchdog.start()
        atexit.register(self.shutdown)

    # ---- plumbing ------------------------------------------------------------------------------

    @property
    def adapter_transport(self) -> str:
        """How adapters reach SGLang: "tensors" (shared memory, same host) or "dir" (engine.adapter_dir)."""
        return self.transport.adapter_transport

    @property
    def pid(self) -> int:
        """The process whose death is the engine's (the scheduler; a launched server's process)."""
        return self.info.pid

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
        return self._wait(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def _wait(self, fut):
        """A result, with the engine's liveness checked while waiting (never forever)."""
        while True:
            try:
                return fut.result(_POLL_S)
            except concurrent.futures.CancelledError:
                # shutdown cancels the loop's calls (a lost engine is shut down while an updater still
                # talks to it): the caller must hear that the engine is gone, not a bare CancelledError
                raise EngineDeadError(str(self._dead or f"{self.label} was shut down")) from None
            except concurrent.futures.TimeoutError:
                if self._dead is not None and not fut.done():
                    fut.cancel()
                    raise EngineDeadError(str(self._dead)) from None

    def _watch(self) -> None:
        """Fail everything pending once the transport says SGLang is gone."""
        while not self._closing.wait(self._liveness_s):
            self._probe = asyncio.run_coroutine_threadsafe(self.transport.dead(), self._loop)
            try:
                reason = self._probe.result(30)
            except BaseException:  # noqa: BLE001 - a probe that could not run (or was cancelled) says nothing
                reason = None
            if self._closed:
                return
            if reason:
                self._die(EngineDeadError(f"{self.label}: {reason}"))
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

    def _submit(self, make_coro, fut: Future) -> Future:
        """Run `make_coro(key)` on the loop for the caller's `fut`, which is resolved however it ends."""
        async def guarded(key: int) -> None:
            try:
                await make_coro()
            except asyncio.CancelledError:
                _resolve(fut, exc=self._dead or EngineDeadError(f"{self.label} was shut down"))
                raise
            except EngineError as e:
                _resolve(fut, exc=e)
            except Exception as e:  # noqa: BLE001 - whatever broke, the caller hears of it
                _resolve(fut, exc=self._dead or EngineError(f"{self.label}: SGLang's reply could not be read: "
                                                            f"{type(e).__name__}: {e}"))
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

    # ---- requests ------------------------------------------------------------------------------

    def _bound(self, slot: Slot) -> int | None:
        with self._lock:
            bound = self._active if slot == ACTIVE else slot
        if bound is not None and self.gate.version[bound] is None:
            raise EngineError(f"slot {bound} is empty: load_adapter into it first")
        return bound  # type: ignore[return-value]

    async def _on_slot(self, slot: int | None, body: dict) -> tuple[dict, int, float]:
        """One request on SGLang: wait for its slot, carry its adapter name, count it in and out."""
        if slot is not None:
            version = await self.gate.enter(slot)
        else:
            version = self._base_version
        lora_path = None if slot is None else slot_name(slot)
        # Every request on a slot carries that slot's adapter; only base-model requests carry none.
        if (slot is None) != (lora_path is None):
            raise EngineError(f"internal error: a request on slot {slot} would run with lora_path={lora_path!r}")
        t_start = time.time()
        self._busy(+1)
        try:
            try:
                out = await self.transport.generate({**body, "lora_path": lora_path})
            except EngineError:
                raise
            except Exception as e:  # noqa: BLE001 - SGLang's own refusals (ValueError, HTTP 400) reach the caller
                raise self._dead or EngineError(f"{self.label} refused the request: {e}") from None
        finally:
            self._busy(-1)
            if slot is not None:
                self.gate.leave(slot)
        return out, version, t_start

    def generate(self, prompt_ids: list[int], sampling: SamplingParams, slot: Slot = ACTIVE,
                 meta: dict | None = None) -> Future[Completion]:
        """Submit one request; returns a Future at once. Bad arguments raise EngineError here.

        `version_start` is the slot's (or base) version when the request entered SGLang;
        `version_end` is its slot's version (a slot is never rewritten under a request) or, for base
        requests, the base version SGLang stamped on its last token.
        """
        req = build_request(prompt_ids, sampling, slot, self.spec.vocab_size, self.max_context, self.num_slots)
        bound = self._bound(req.slot)

        async def run() -> None:
            out, version, t_start = await self._on_slot(bound, req.body(None))
            reply = read_reply(out, req.truncated)
            version_end = version if bound is not None else weight_version(reply.meta_info, self._base_version)
            c, meta_info = self._counters, reply.meta_info
            c["tokens_generated"] += len(reply.output_ids)
            cached = int(meta_info.get("cached_tokens") or 0)
            c["prefill_tokens"] += max(0, int(meta_info.get("prompt_tokens") or len(req.prompt_ids)) - cached)
            c["prefix_cache_hits"] += cached > 0
            c["aborted"] += reply.finish == "abort"
            _resolve(fut, Completion(
                prompt_ids=req.prompt_ids, output_ids=reply.output_ids, logprobs=reply.logprobs,
                finish_reason=reply.finish, slot=bound, version_start=version, version_end=version_end,
                t_start=t_start, t_end=time.time(), meta=meta if meta is not None else {}, detail=reply.detail,
            ))

        fut: Future = Future()
        return self._submit(run, fut)

    def score(self, prompt_ids: list[int], continuation_ids: list[int], slot: Slot = ACTIVE) -> list[float]:
        """Teacher-forced logprobs (temperature 1) of each continuation token after the prompt."""
        cont = check_ids(list(continuation_ids), self.spec.vocab_size, "continuation")
        req = build_request(prompt_ids, SamplingParams(max_new_tokens=1, temperature=0.0), slot,
                            self.spec.vocab_size, self.max_context, self.num_slots)
        if not cont or len(req.prompt_ids) + len(cont) >= self.max_context:
            raise EngineError(f"continuation must have 1..{self.max_context - len(req.prompt_ids) - 1} tokens, "
                              f"got {len(cont)}")
        bound = self._bound(req.slot)

        async def run() -> None:
            out, _, _ = await self._on_slot(bound, score_body(req.prompt_ids, cont))
            _resolve(fut, read_scores(out))

        fut: Future = Future()
        return self._wait(self._submit(run, fut))

    # ---- adapters ------------------------------------------------------------------------------

    def load_adapter(self, slot: int, tensors: dict[str, torch.Tensor], adapter_config: dict, version: int) -> float:
        """Write a LoRA adapter into a slot (gate.py): its name is unloaded after the requests on it
        finish, and loaded again. The other slots keep serving. Bad input raises EngineError before
        anything reaches SGLang; a load SGLang refuses puts the previous adapter back. Refused while
        paused if the slot holds an adapter. Returns the write time."""
        slot = check_slot(slot, self.num_slots)
        check_version(version)
        named, config = prepare_adapter(tensors, adapter_config, self.spec, self._hf_config, self.options.lora,
                                        self.options.max_lora_rank, self._targets, self._dtype)
        name = slot_name(slot)
        t = self.transport
        return self._call(self.gate.rewrite(
            slot, version, self._paused, load=lambda: t.load_adapter(name, named, config, version),
            unload=lambda: t.unload_adapter(name), restore=lambda backup: t.load_adapter(name, *backup),
            backup=(named, config, version)))

    def activate(self, slot: int | None) -> None:
        """New ACTIVE requests carry this slot's adapter (None = base weights) from now on."""
        if slot is not None:
            slot = check_slot(slot, self.num_slots)
        with self._lock:
            self._check_alive()
            if slot is not None and self.gate.version[slot] is None:
                raise EngineError(f"cannot activate slot {slot}: it is empty")
            self._active = slot

    def clear_slots(self) -> None:
        """Unload adapters a previous Orbit engine left under this engine's slot names (a server that
        outlived its last run): SGLang refuses to load a name that is still loaded."""
        self._call(self._release_slots(range(self.num_slots)))

    async def _release_slots(self, slots) -> None:
        for slot in slots:
            try:
                await asyncio.wait_for(self.transport.unload_adapter(slot_name(slot)), 10)
            except Exception:  # noqa: BLE001 - not loaded, or the server is going: nothing to release
                pass

    # ---- pause, flush, weights -----------------------------------------------------------------

    def pause_generation(self, mode: PauseMode = "in_place") -> None:
        if mode not in PAUSE_MODES:
            raise EngineError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._call(self._pause(mode))

    async def _pause(self, mode: str) -> None:
        if not self._paused:
            self._paused, self._pause_t0 = True, time.perf_counter()
            self._busy(0)
        if mode == "retract":
            self._counters["retracted"] += self._inflight
        await self.transport.pause(mode)

    def continue_generation(self) -> None:
        self._call(self._continue())

    async def _continue(self) -> None:
        await self.transport.resume()
        if self._paused:
            self._counters["paused_s"] += time.perf_counter() - self._pause_t0
            self._paused = False
            self._busy(0)

    def flush_cache(self) -> None:
        """Drop SGLang's radix cache. SGLang refuses while requests run (also during an in_place
        pause): pause with 'retract' or 'abort' first; EngineError says so."""
        ok, _ = self._call(self.transport.flush())
        if not ok:
            raise EngineError(f"{self.label} refused flush_cache: requests are running. Pause with 'retract' or "
                              "'abort' first (never flush during an 'in_place' pause with requests running)")

    def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Full-weight push by HF names (any subset of the checkpoint's tensors). Validated first."""
        check_version(version)
        if not isinstance(tensors, dict) or not tensors:
            raise EngineError("update_weights: no tensors given")
        named = []
        for name, t in tensors.items():
            if name not in self._shapes:
                raise EngineError(f"update_weights: unknown parameter name {name!r}")
            check_tensor(f"update_weights: {name}", t, self._shapes[name])
            named.append((name, t.detach().to("cpu", self._dtype, copy=True).contiguous()))
        ok, message = self._call(self.transport.update_weights(named, version))
        if not ok:
            raise EngineError(f"{self.label} refused the weights: {message}")
        self._base_version = version

    def release_memory(self) -> None:
        """SGLang's `release_memory_occupation` with its memory saver on; otherwise nothing (without
        it SGLang would flush its cache and stash the weights but free nothing)."""
        if self.transport.memory_saver:
            self._call(self.transport.release_memory())
        else:
            self._check_alive()

    def resume_memory(self) -> None:
        if self.transport.memory_saver:
            self._call(self.transport.resume_memory())
        else:
            self._check_alive()

    def stats(self, timeout: float | None = None) -> EngineStats:  # noqa: ARG002 - counters are local
        self._check_alive()
        c = self._counters
        now = time.perf_counter()
        busy = c["busy_s"] + (now - self._busy_t0 if self._busy_t0 is not None else 0.0)
        paused = c["paused_s"] + (now - self._pause_t0 if self._paused else 0.0)
        gate = self.gate
        return EngineStats(
            tokens_generated=c["tokens_generated"], busy_s=busy, paused_s=paused, running=self._inflight,
            waiting=sum(gate.held), prefix_cache_hits=c["prefix_cache_hits"], active_slot=self._active,
            slot_versions=tuple(gate.version), slot_requests=gate.requests(), base_version=self._base_version,
            paused=self._paused, prefill_tokens=c["prefill_tokens"], aborted=c["aborted"], retracted=c["retracted"],
        )

    # ---- lifetime ------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Fail what is in flight, stop the loop, stop SGLang's (or the started server's) own
        processes; an attached server is left running. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.shutdown)
        self._die(EngineDeadError(f"{self.label} was shut down"))
        self._closing.set()
        if self._probe is not None:
            self._probe.cancel()
        self._watchdog.join(2)

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=2)
            if getattr(self.transport, "attached", False):  # a server that stays up: take our adapters off it
                await self._release_slots([s for s, v in enumerate(self.gate.version) if v is not None])
            closer = getattr(self.transport, "aclose", None)
            if closer is not None:
                await closer()

        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(cancel_all(), self._loop).result(5)
            except Exception:  # noqa: BLE001 - shutting down regardless
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self.transport.close()
        if not self._thread.is_alive():
            self._loop.close()

    def kill(self) -> None:
        """A dead or hung engine: stop the server Orbit started first (nothing there to save; the orderly
        part of shutdown can take seconds against a dead server), then shut down. In-process, shutting
        down kills only SGLang's own processes anyway."""
        stop = getattr(self.transport, "stop_server", None)
        if stop is not None:
            stop()
        self.shutdown()

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
