"""Orbit's engine protocol on SGLang, over either transport (transport.py: in-process; http.py:
an SGLang server). One class for both: the slot gate (gate.py), request checks and replies
(requests.py), adapter preparation (adapters.py), the event loop and liveness (loop.py) and the
accounting below are the same, only how a call reaches SGLang differs.
"""

from __future__ import annotations

import asyncio
import atexit
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import torch

from orbit.engine.base import (
    ACTIVE,
    Capabilities,
    Completion,
    EngineError,
    EngineInfo,
    EngineStats,
    PauseMode,
    SamplingParams,
    Slot,
    resolve,
)
from orbit.engine.checks import check_pause_mode, check_slot, check_tensor, check_version
from orbit.engine.serving import ActiveSlot
from orbit.engine.sglang.adapters import prepare_adapter
from orbit.engine.sglang.event_loop import POLL_S, EngineLoop
from orbit.engine.sglang.gate import SlotGate, slot_name
from orbit.engine.sglang.process import SGLangOptions
from orbit.engine.sglang.requests import build_request, weight_version
from orbit.engine.sglang.transport import Transport
from orbit.engine.sglang_cpu.adapter_format import sglang_target_modules
from orbit.engine.spec import DTYPES, ModelSpec, checkpoint_shapes


class SGLangEngine:
    """Implements orbit.engine.base.Engine on SGLang."""

    def __init__(
        self,
        transport: Transport,
        loop: asyncio.AbstractEventLoop,
        model_path: Path,
        spec: ModelSpec,
        hf_config: dict,
        options: SGLangOptions,
        max_context: int,
        pid: int,
        label: str,
        liveness_s: float = POLL_S,
    ) -> None:
        self.transport = transport
        self._killed = False  # kill(): dead or hung, nothing orderly to do on its server
        self.model_path = model_path
        self.spec = spec
        self.options = options
        self.label = label  # "SGLang engine" or "SGLang server http://...": named in errors
        self.max_context = max_context
        self.num_slots = options.slots
        # Upstream SGLang serves LoRA only (OFT goes as merged weights); a load unloads the slot's
        # old adapter, which waits for its requests (so never under paused ones); flush_cache is
        # refused while requests run, an in_place pause included.
        self.capabilities = Capabilities(
            slots=options.slots,
            oft_slots=False,
            loads_while_paused=False,
            flush_while_running=False,
        )
        self.adapter_transport = transport.adapter_transport
        self._hf_config = hf_config
        self._shapes = checkpoint_shapes(model_path)
        self._dtype = DTYPES[options.dtype]
        self._targets = set(sglang_target_modules(options.lora_target_modules))
        self.info = EngineInfo(  # the same start-up facts the embedded client exposes
            pid=pid,
            model_type=spec.model_type,
            vocab_size=spec.vocab_size,
            max_context=max_context,
            eos_token_ids=spec.eos_token_ids,
            num_layers=spec.num_layers,
            device=options.device,
            dtype=options.dtype,
        )
        self.gate = SlotGate(options.slots)  # loop-thread state
        self._lock = threading.Lock()  # guards what caller threads read and write below
        self.active = ActiveSlot(holds=lambda slot: self.gate.version[slot] is not None)
        self._base_version = 0
        self._paused = False
        self._pause_t0 = 0.0
        self._inflight = 0
        self._busy_t0: float | None = None
        self._counters = {
            "tokens_generated": 0,
            "busy_s": 0.0,
            "paused_s": 0.0,
            "prefill_tokens": 0,
            "aborted": 0,
            "retracted": 0,
            "prefix_cache_hits": 0,
        }
        self.loop = EngineLoop(loop, transport.dead, label, liveness_s)
        self._call = self.loop.call
        atexit.register(self.shutdown)

    # ---- plumbing ------------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        """The process whose death is the engine's (the scheduler; a launched server's process)."""
        return self.info.pid

    def _busy(self, delta: int) -> None:
        """Track wall time with at least one request in flight and the engine not paused
        (busy_s)."""
        now = time.perf_counter()
        if self._busy_t0 is not None:
            self._counters["busy_s"] += now - self._busy_t0
            self._busy_t0 = None
        self._inflight += delta
        if self._inflight > 0 and not self._paused:
            self._busy_t0 = now

    # ---- requests ------------------------------------------------------------------------------

    async def _on_slot(self, slot: int | None, body: dict) -> tuple[dict, int, float]:
        """One request on SGLang: wait for its slot, carry its adapter name, count it in and out."""
        if slot is not None:
            version = await self.gate.enter(slot)
        else:
            version = self._base_version
        lora_path = None if slot is None else slot_name(slot)
        # Every request on a slot carries that slot's adapter; only base-model requests carry none.
        if (slot is None) != (lora_path is None):
            raise EngineError(
                f"internal error: a request on slot {slot} would run with lora_path={lora_path!r}"
            )
        t_start = time.time()
        self._busy(+1)
        try:
            try:
                out = await self.transport.generate({**body, "lora_path": lora_path})
            except EngineError:
                raise
            # SGLang's own refusals (ValueError, HTTP 400) reach the caller
            except Exception as e:  # noqa: BLE001
                raise self.loop.dead or EngineError(
                    f"{self.label} refused the request: {e}"
                ) from None
        finally:
            self._busy(-1)
            if slot is not None:
                self.gate.leave(slot)
        return out, version, t_start

    def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        slot: Slot = ACTIVE,
        meta: dict | None = None,
    ) -> Future[Completion]:
        """Submit one request; returns a Future at once. Bad arguments raise EngineError here.

        `version_start` is the slot's (or base) version when the request entered SGLang;
        `version_end` is its slot's version (a slot is never rewritten under a request) or, for base
        requests, the base version SGLang stamped on its last token.
        """
        req = build_request(
            prompt_ids, sampling, slot, self.spec.vocab_size, self.max_context, self.num_slots
        )
        bound = self.active.bind(req.slot)

        async def run() -> None:
            out, version, t_start = await self._on_slot(bound, req.body(None))
            reply = req.read(out)
            version_end = (
                version
                if bound is not None
                else weight_version(reply.meta_info, self._base_version)
            )
            c, meta_info = self._counters, reply.meta_info
            c["tokens_generated"] += len(reply.output_ids)
            cached = int(meta_info.get("cached_tokens") or 0)
            c["prefill_tokens"] += max(
                0, int(meta_info.get("prompt_tokens") or len(req.prompt_ids)) - cached
            )
            c["prefix_cache_hits"] += cached > 0
            c["aborted"] += reply.finish == "abort"
            resolve(
                fut,
                Completion(
                    prompt_ids=req.prompt_ids,
                    output_ids=reply.output_ids,
                    logprobs=reply.logprobs,
                    finish_reason=reply.finish,
                    slot=bound,
                    version_start=version,
                    version_end=version_end,
                    t_start=t_start,
                    t_end=time.time(),
                    meta=meta if meta is not None else {},
                    detail=reply.detail,
                    prompt_logprobs=reply.prompt_logprobs,
                    prompt_top=reply.prompt_top,
                    prompt_target_logprobs=reply.prompt_target_logprobs,
                    output_top=reply.output_top,
                ),
            )

        fut: Future = Future()
        return self.loop.submit(run, fut)

    # ---- adapters ------------------------------------------------------------------------------

    def load_adapter(
        self, slot: int, tensors: dict[str, torch.Tensor], adapter_config: dict, version: int
    ) -> float:
        """Write a LoRA adapter into a slot (gate.py): its name is unloaded after the requests on it
        finish, and loaded again. The other slots keep serving. Bad input raises EngineError before
        anything reaches SGLang; a load SGLang refuses puts the previous adapter back. Refused while
        paused if the slot holds an adapter. Returns the write time."""
        slot = check_slot(slot, self.num_slots)
        check_version(version)
        named, config = prepare_adapter(
            tensors,
            adapter_config,
            self.spec,
            self._hf_config,
            self.options.lora,
            self.options.max_lora_rank,
            self._targets,
            self._dtype,
        )
        name = slot_name(slot)
        t = self.transport
        return self._call(
            self.gate.rewrite(
                slot,
                version,
                self._paused,
                load=lambda: t.load_adapter(name, named, config, version),
                unload=lambda: t.unload_adapter(name),
                restore=lambda backup: t.load_adapter(name, *backup),
                backup=(named, config, version),
            )
        )

    def activate(self, slot: int | None) -> None:
        """New ACTIVE requests carry this slot's adapter (None = base weights) from now on."""
        if slot is not None:
            slot = check_slot(slot, self.num_slots)
        self.loop.check_alive()
        self.active.set(slot)

    def clear_slots(self) -> None:
        """Unload adapters a previous Orbit engine left under this engine's slot names (a server
        that outlived its last run): SGLang refuses to load a name that is still loaded."""
        self._call(self._release_slots(range(self.num_slots)))

    async def _release_slots(self, slots) -> None:
        for slot in slots:
            try:
                await asyncio.wait_for(self.transport.unload_adapter(slot_name(slot)), 10)
            # not loaded, or the server is going: nothing to release
            except Exception:  # noqa: BLE001
                pass

    # ---- pause, flush, weights -----------------------------------------------------------------

    def pause_generation(self, mode: PauseMode = "in_place") -> None:
        self._call(self._pause(check_pause_mode(mode)))

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
            raise EngineError(
                f"{self.label} refused flush_cache: requests are running. Pause with 'retract' or "
                "'abort' first (never flush during an 'in_place' pause with requests running)"
            )

    def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Full-weight push by HF names (any subset of the checkpoint's tensors). Validated
        first."""
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
            self.loop.check_alive()

    def resume_memory(self) -> None:
        if self.transport.memory_saver:
            self._call(self.transport.resume_memory())
        else:
            self.loop.check_alive()

    def lend_threads(self, n: int) -> None:  # noqa: ARG002 - the protocol's
        """Ignored: SGLang's scheduler process fixes its torch threads when it starts."""

    def heartbeat(self) -> int | None:
        """None: stats are this process's own counters, always answered; whether SGLang lives is
        the loop's watchdog's to say (transport.dead: its processes, a server's /health and the
        CPU time a started server spends)."""
        return None

    # counters are local
    def stats(self, timeout: float | None = None) -> EngineStats:  # noqa: ARG002
        self.loop.check_alive()
        c = self._counters
        now = time.perf_counter()
        busy = c["busy_s"] + (now - self._busy_t0 if self._busy_t0 is not None else 0.0)
        paused = c["paused_s"] + (now - self._pause_t0 if self._paused else 0.0)
        gate = self.gate
        return EngineStats(
            tokens_generated=int(c["tokens_generated"]),
            busy_s=busy,
            paused_s=paused,
            running=self._inflight,
            waiting=sum(gate.held),
            prefix_cache_hits=int(c["prefix_cache_hits"]),
            active_slot=self.active.get(),
            slot_versions=tuple(gate.version),
            slot_requests=gate.requests(),
            base_version=self._base_version,
            paused=self._paused,
            prefill_tokens=int(c["prefill_tokens"]),
            aborted=int(c["aborted"]),
            retracted=int(c["retracted"]),
        )

    # ---- lifetime ------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Fail what is in flight, stop the loop, stop SGLang's (or the started server's) own
        processes; an attached server is left running. Idempotent."""
        atexit.unregister(self.shutdown)

        async def release() -> None:
            # A server that stays up: take our adapters off it. Not after `kill`: a hung server that
            # answers again is re-attached (orbit/run/revive.py), and a late unload would hit the
            # new slots.
            if self.transport.attached and not self._killed:
                await self._release_slots(
                    [s for s, v in enumerate(self.gate.version) if v is not None]
                )
                if self._base_version:  # full pushes replaced its weights: the checkpoint's again
                    await self.transport.restore_weights(str(self.model_path))
            await self.transport.aclose()

        if self.loop.close(release):
            self.transport.close()

    def kill(self) -> None:
        """A dead or hung engine: stop the server Orbit started first (nothing there to save; the
        orderly part of shutdown can take seconds against a dead server), then shut down.
        In-process, shutting down kills only SGLang's own processes anyway."""
        self._killed = True
        self.transport.stop_server()
        self.shutdown()

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
