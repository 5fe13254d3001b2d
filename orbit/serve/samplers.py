"""Sampling: the weights a sampling session samples from (the base, a saved checkpoint, a
snapshot of a training client, or a training client's inflight target), brought to the engines as an
adapter in a slot, as Orbit's pushes bring theirs, never as a reload of the base.

Each engine's slots hold the weights of the sessions sampled most recently (`SlotCache`): a request
for weights already in a slot goes straight there; otherwise the least recently used slot with no
request running is written (a slot under a running request is never written), and when every slot
is busy the request waits for one, within a bound. Requests of every session are batched together
on the engines (each row carries its slot).

An inflight target (Tinker's `kind="inflight"`) is one key whose versions grow: a publish loads the
new version into an idle slot of every engine that holds the key (`Sampler.publish`, in the
background), and the engine's pointer for the key then moves to it: the flip. Requests running on
the old slot finish there (nothing is drained or paused: other tenants share the engine, as a
sweep's runs do, docs/design.md §10); requests admitted after it run on the new one, and the old
slot is free once its last request ends.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass

from torch import Tensor

from orbit.engine.base import Completion, Engine, SamplingParams
from orbit.serve import wire
from orbit.serve.futures import Refused, RequestFailed
from orbit.serve.wire import Sampled, Sequence

log = logging.getLogger(__name__)
SLOT_WAIT_S = 120.0  # a request waits this long at most for a free slot


class SamplingError(Refused):
    """A sample Orbit will not take (a refusal, the client's to fix)."""


@dataclass(frozen=True)
class Weights:
    """What a session samples from: `key` names it (the same key and version, the same weights); no
    tensors: the base model. An inflight target's versions share its key; `floor` is the oldest
    version a request may run on (the version its session was created at)."""

    key: str
    tensors: dict[str, Tensor] | None = None
    config: dict | None = None
    version: int = 0
    floor: int = 0


BASE = Weights("base")


class SlotCache:
    """One engine's adapter slots and the weights each holds."""

    def __init__(self, engine: Engine, slots: int) -> None:
        self.engine = engine
        self.held: list[str | None] = [None] * slots  # per slot: the weights' key
        self.versions = [0] * slots  # per slot: the version of its key it holds
        self.running = [0] * slots  # per slot: requests in flight
        self.used = [0.0] * slots  # per slot: when last asked for
        self.flips = 0  # times a key moved to a newer version here
        self._versions = itertools.count(1)
        self._cond = threading.Condition()
        self._loading: set[int] = set()

    def acquire(self, weights: Weights, wait_s: float = SLOT_WAIT_S) -> int | None:
        """The slot holding `weights` (or, for an inflight target, its newest version here at or
        after the floor), loading it if none does (None: the base model, no slot). The caller
        releases it when its requests are done."""
        if weights.tensors is None:
            return None
        deadline = time.monotonic() + wait_s
        with self._cond:
            while True:
                slot = self._ready(weights.key, weights.floor)
                stale = slot is not None and self.versions[slot] < weights.version
                if slot is not None and not (stale and self._can_load(weights)):
                    self.running[slot] += 1
                    self.used[slot] = time.monotonic()
                    return slot
                if not self._coming(weights) and (free := self._free()) is not None:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SamplingError(
                        f"every one of the engine's {len(self.held)} adapter slots stayed busy for "
                        f"{wait_s:g} s (more sampling sessions at once than engine.slots)"
                    )
                self._cond.wait(min(left, 1.0))
            self._claim(free, weights, running=1)
        self._load(free, weights)
        return free

    def prepare(self, weights: Weights) -> None:
        """Load a newer version of a key this engine holds into an idle slot, and flip to it; no-op
        when it holds the key no longer, already has this version or has no idle slot (a request
        then loads it)."""
        with self._cond:
            slot = self._ready(weights.key, 0)
            if slot is None or self.versions[slot] >= weights.version or self._coming(weights):
                return
            free = self._free()
            if free is None:
                return
            self._claim(free, weights, running=0)
        self._load(free, weights)

    def release(self, slot: int | None) -> None:
        if slot is None:
            return
        with self._cond:
            self.running[slot] -= 1
            self._drop_stale()
            self._cond.notify_all()

    def forget(self, key: str) -> None:
        """Weights that no longer exist: their slots may be written at once (when idle)."""
        with self._cond:
            for i, k in enumerate(self.held):
                if k == key and self.running[i] == 0 and i not in self._loading:
                    self.held[i] = None

    def load(self) -> int:
        with self._cond:
            return sum(self.running)

    def serving(self) -> dict[str, int]:
        """Per key: the newest version a request would run on here now."""
        with self._cond:
            found: dict[str, int] = {}
            for i, key in enumerate(self.held):
                if key is not None and i not in self._loading:
                    found[key] = max(found.get(key, 0), self.versions[i])
            return found

    def _ready(self, key: str, floor: int) -> int | None:
        """The slot with the newest loaded version of `key` at or after `floor`."""
        ready = [
            i
            for i, k in enumerate(self.held)
            if k == key and self.versions[i] >= floor and i not in self._loading
        ]
        return max(ready, key=lambda i: self.versions[i]) if ready else None

    def _coming(self, weights: Weights) -> bool:
        """A slot is being loaded with this version of the key, or a newer one."""
        return any(
            self.held[i] == weights.key and self.versions[i] >= weights.version
            for i in self._loading
        )

    def _can_load(self, weights: Weights) -> bool:
        return not self._coming(weights) and self._free() is not None

    def _claim(self, slot: int, weights: Weights, running: int) -> None:
        self.held[slot], self.versions[slot], self.running[slot] = (
            weights.key,
            weights.version,
            running,
        )
        self._loading.add(slot)

    def _load(self, slot: int, weights: Weights) -> None:
        """Write the claimed `slot`; once written, requests for the key run on it (the flip)."""
        try:
            assert weights.tensors is not None and weights.config is not None
            self.engine.load_adapter(slot, weights.tensors, weights.config, next(self._versions))
        except BaseException:
            with self._cond:
                self.held[slot], self.running[slot] = None, 0
                self._loading.discard(slot)
                self._cond.notify_all()
            raise
        with self._cond:
            self._loading.discard(slot)
            self.used[slot] = time.monotonic()
            older = [i for i, k in enumerate(self.held) if k == weights.key and i != slot]
            if any(self.versions[i] < weights.version for i in older):
                self.flips += 1
            self._drop_stale()
            self._cond.notify_all()

    def _drop_stale(self) -> None:
        """Free the idle slots of a key a newer version of which is loaded here."""
        for i, key in enumerate(self.held):
            if key is None or self.running[i] or i in self._loading:
                continue
            newest = self._ready(key, 0)
            if newest is not None and self.versions[newest] > self.versions[i]:
                self.held[i] = None

    def _free(self) -> int | None:
        idle = [i for i, n in enumerate(self.running) if n == 0 and i not in self._loading]
        if not idle:
            return None
        empty = [i for i in idle if self.held[i] is None]
        return empty[0] if empty else min(idle, key=lambda i: self.used[i])


@dataclass(frozen=True)
class Stops:
    """How a sample ends besides max_tokens: stop strings (checked on the decoded text), stop token
    ids, and whether the model's end-of-sequence tokens end it."""

    strings: tuple[str, ...] = ()
    token_ids: tuple[int, ...] = ()
    eos: bool = True


class Sampler:
    """Samples on the engines: `sample` returns a future of the sequences."""

    def __init__(
        self, engines: list[Engine], slots: int, decode: Callable[[list[int]], str]
    ) -> None:
        self.caches = [SlotCache(e, slots) for e in engines]
        self.decode = decode

    def sample(
        self,
        weights: Weights,
        prompt: list[int],
        params: SamplingParams,
        n: int,
        stops: Stops,
        last_n: int | None = None,
    ) -> Future[Sampled]:
        """`n` samples of `prompt` (seeds params.seed + i when a seed is given) on the least loaded
        engine; with `params.prompt_logprobs` >= 0 the prompt's logprobs too (from the first
        sample's request; `last_n`: only the last n positions'). Blocks while a slot is loaded
        (call it off the event loop)."""
        cache = min(self.caches, key=SlotCache.load)
        slot = cache.acquire(weights)
        result: Future[Sampled] = Future()
        futures = []
        try:
            for i in range(n):
                seed = None if params.seed is None else params.seed + i
                p = SamplingParams(
                    max_new_tokens=params.max_new_tokens,
                    temperature=params.temperature,
                    top_p=params.top_p,
                    top_k=params.top_k,
                    stop_token_ids=stops.token_ids,
                    seed=seed,
                    ignore_eos=not stops.eos,
                    prompt_logprobs=params.prompt_logprobs if i == 0 else -1,
                    prompt_targets=params.prompt_targets if i == 0 else None,
                    output_top=params.output_top,
                )
                futures.append(cache.engine.generate(prompt, p, slot=slot))
        except BaseException:
            cache.release(slot)
            raise
        pending = [len(futures)]
        lock = threading.Lock()

        def one_done(_: Future[Completion]) -> None:
            with lock:
                pending[0] -= 1
                if pending[0]:
                    return
            cache.release(slot)
            try:
                first = futures[0].result()
                sequences = [self._sequence(f.result(), stops) for f in futures]
                scored = _scored(first, last_n)
                result.set_result(Sampled(sequences, *scored, first.prompt_target_logprobs))
            except BaseException as err:  # noqa: BLE001 - the engine's error is the sample's
                result.set_exception(err)

        for f in futures:
            f.add_done_callback(one_done)
        return result

    def forget(self, key: str) -> None:
        for cache in self.caches:
            cache.forget(key)

    def publish(self, weights: Weights, executor: Executor) -> list[Future[None]]:
        """A new version of an inflight target: each engine that holds the key loads it into an
        idle slot and flips to it, in the background (the publish does not wait for them)."""
        futures = [executor.submit(cache.prepare, weights) for cache in self.caches]
        for i, f in enumerate(futures):
            f.add_done_callback(functools.partial(_log_failed_flip, engine=i, weights=weights))
        return futures

    def _sequence(self, done: Completion, stops: Stops) -> Sequence:
        """A completion as the wire returns it: cut right after the token whose text completes a
        stop string (which stays in it), stopped unless it ran to max_tokens."""
        tokens, logprobs, top = list(done.output_ids), list(done.logprobs), done.output_top
        if done.finish_reason == "abort":
            raise RuntimeError(f"the engine aborted the request ({done.detail or 'no reason'})")
        if stops.strings:
            for k in range(len(tokens)):
                text = self.decode(tokens[: k + 1])
                if any(s in text for s in stops.strings):
                    cut = None if top is None else top[: k + 1]
                    return Sequence(tokens[: k + 1], logprobs[: k + 1], stopped=True, top=cut)
        return Sequence(tokens, logprobs, stopped=done.finish_reason == "stop", top=top)


def _scored(
    done: Completion, last_n: int | None
) -> tuple[list[float | None] | None, list[list[tuple[int, float]]] | None]:
    """A completion's prompt logprobs and top-k, only the last `last_n` positions kept."""
    values, top = done.prompt_logprobs, done.prompt_top
    if values is None or last_n is None:
        return values, top
    cut = len(values) - last_n
    kept: list[float | None] = [None for _ in range(cut)]
    kept += values[cut:]
    empty: list[list[tuple[int, float]]] = [[] for _ in range(cut)]
    return kept, None if top is None else empty + top[cut:]


def _log_failed_flip(done: Future, engine: int, weights: Weights) -> None:
    """A background load that failed: the engine keeps serving the version it had (its next request
    for the key tries again)."""
    if not done.cancelled() and (err := done.exception()) is not None:
        log.warning("engine %d did not load %s v%d: %s", engine, weights.key, weights.version, err)


def onto(
    sampled: Future,
    result: Future,
    keep: Callable[[Sampled], None] | None = None,
    pool: Executor | None = None,
    targets: wire.Targets | None = None,
) -> None:
    """A `Sampler.sample` call's outcome (`sampled`, submitted off the event loop) onto a request's
    future: the sequences as the wire's bytes, or the failure said to its client. `keep`: called
    with the sequences before the client can see them (record_stability_info records them), on
    `pool`: a database write must not hold the engine's thread that completed the sample."""
    try:
        inner: Future = sampled.result()
    except Refused as err:
        result.set_exception(RequestFailed(str(err), "user"))
        return
    except BaseException as err:  # noqa: BLE001 - the request's failure, said to its client
        result.set_exception(RequestFailed(f"{type(err).__name__}: {err}", "server"))
        return

    def finish(f: Future) -> None:
        try:
            if keep is not None:
                keep(f.result())
            result.set_result(wire.sample_response(f.result(), targets))
        except BaseException as err:  # noqa: BLE001 - as above
            result.set_exception(RequestFailed(f"{type(err).__name__}: {err}", "server"))

    def done(f: Future) -> None:
        if keep is not None and pool is not None:
            pool.submit(finish, f)
        else:
            finish(f)

    inner.add_done_callback(done)
