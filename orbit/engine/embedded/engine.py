"""The in-process engine: requests, the step loop, and the protocol's control calls.

Single-threaded by design: process.py runs it in its own process and interleaves control commands
between steps, so a control call always sees the engine between two forwards. A step is: admit
waiting requests into free KV rows and prefill them (prefix-cache hits and duplicate prompts
skip the forward), then one batched decode forward over every running row.

Slot rules (docs/design.md §3):
- `generate(slot=ACTIVE)` binds the request to the active slot at submission; the binding never
  changes. `version_start` is the bound slot's (or base) version when the request is admitted;
  `version_end` is that same slot's (or base) version when it finishes, so the two differ only
  if the weights under the request changed while it was paused (adapter or full push).
- A slot is never written under a running request: while generation runs, `load_adapter(s)`
  first aborts the requests running on s (partial output, reason "abort"). While paused, paused
  requests keep their binding: in-place ones continue on their KV, retracted ones recompute.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from orbit.engine.base import (
    ACTIVE,
    Completion,
    EngineError,
    EngineStats,
    FinishReason,
    SamplingParams,
    Slot,
)
from orbit.engine.checks import (
    check_pause_mode,
    check_prompt,
    check_scoring,
    check_slot,
    check_version,
)
from orbit.engine.embedded.kv_cache import KVPool, PrefixCache, PrefixEntry, PrefixKey
from orbit.engine.embedded.model import (
    Decoder,
    HeadDelta,
    Project,
    plain_linear,
    validate_weights,
)
from orbit.engine.embedded.sampler import gather_rows, sample, top_logprobs
from orbit.engine.embedded.scheduler import Scheduler, Sequence
from orbit.engine.embedded.slots import NUM_SLOTS, SlotBatch, SlotWeights, parse_adapter
from orbit.engine.serving import ActiveSlot


@dataclass(frozen=True)
class EngineOptions:
    max_running: int = 32
    max_context: int | None = None  # None: min(max_position_embeddings, 4096)
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    prefix_cache_size: int = 64  # prompts kept (LRU)
    # prompt tokens admitted per step (at least one request). Not less: a long step is not taken for
    # a hang (orbit/engine/liveness.py), and bench/investigations/prefill_step.py measured smaller
    # steps slower
    max_prefill_tokens: int = 4096
    slots: int = NUM_SLOTS  # adapter slots (engine.slots)
    # Threads the trainer lends (process.py) are used for a step only if its rows x the model's
    # weights reach this. bench/investigations/engine_rows.py on SmolLM2 (134.5M weights), 2
    # threads against 1:
    # 0.95x at 1 row, 0.96x at 4, 1.07x at 16, 1.44x at 32, 1.42x at 64; a step of a few rows reads
    # the weights once from memory whatever the threads. A tests' tiny model was 2-10x slower.
    lend_min_work: float = 4e9


class EngineCore:
    """Embedded engine without threads or processes. `EmbeddedClient` is the real entry point."""

    def __init__(self, model_path: str, options: EngineOptions | None = None) -> None:
        self.options = opts = options or EngineOptions()
        if opts.max_running < 1:
            raise EngineError(f"max_running must be >= 1, got {opts.max_running}")
        self.decoder = Decoder(
            model_path, max_context=opts.max_context, dtype=opts.dtype, device=opts.device
        )
        self.spec = self.decoder.spec
        self.max_context = self.decoder.max_context
        s = self.spec
        self.pool = KVPool(
            s.num_layers,
            opts.max_running,
            s.num_kv_heads,
            self.max_context,
            s.head_dim,
            self.decoder.dtype,
            self.decoder.device,
        )
        self.cache = PrefixCache(opts.prefix_cache_size)
        # the matmul weights a token goes through (a tied output projection once)
        weights = {t.data_ptr(): t.numel() for t in self.decoder.params().values() if t.dim() == 2}
        self.weights = sum(weights.values())
        self.scheduler = Scheduler(opts.max_running, opts.max_prefill_tokens)
        if opts.slots < 1:
            raise EngineError(f"slots must be >= 1, got {opts.slots}")
        self.slots: list[SlotWeights | None] = [None] * opts.slots
        self.active = ActiveSlot(holds=lambda slot: self.slots[slot] is not None)
        self.base_version = 0
        self.paused = False
        self.released = False
        self.rng = torch.Generator().manual_seed(opts.seed)  # seeds for requests without one
        self._finished: list[tuple[int, Completion]] = []
        self._next_rid = 0
        self._pause_t0 = 0.0
        self.counters = {
            "tokens_generated": 0,
            "busy_s": 0.0,
            "paused_s": 0.0,
            "prefill_tokens": 0,
            "aborted": 0,
            "aborted_on_load": 0,
            "retracted": 0,
        }

    # ---- requests ------------------------------------------------------------------------------

    def submit(
        self,
        prompt_ids: Seq[int],
        sampling: SamplingParams,
        slot: Slot = ACTIVE,
        meta: dict | None = None,
        rid: int | None = None,
    ) -> int:
        """Queue a request; returns its id. Raises EngineError for bad input (nothing queued)."""
        prompt = check_prompt(prompt_ids, self.spec.vocab_size, self.max_context)
        self._check_sampling(sampling)
        check_scoring(sampling, prompt, self.spec.vocab_size)
        bound = self._resolve_slot(slot)
        if rid is None:
            rid = self._next_rid
            self._next_rid += 1
        stops = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stops.update(self.spec.eos_token_ids)
        generator = None
        if sampling.temperature > 0:
            seed = (
                sampling.seed
                if sampling.seed is not None
                else int(torch.randint(0, 2**62, (), generator=self.rng))
            )
            generator = torch.Generator().manual_seed(seed)
        seq = Sequence(
            rid,
            prompt,
            sampling,
            bound,
            frozenset(stops),
            generator,
            meta if meta is not None else {},
        )
        self.scheduler.add(seq)
        return rid

    def _check_sampling(self, sampling: SamplingParams) -> None:
        if not isinstance(sampling, SamplingParams):
            raise EngineError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        sampling.check()
        if any(isinstance(t, bool) or not isinstance(t, int) for t in sampling.stop_token_ids):
            raise EngineError(f"stop_token_ids must be ints, got {sampling.stop_token_ids!r}")
        if sampling.seed is not None and (
            isinstance(sampling.seed, bool) or not isinstance(sampling.seed, int)
        ):
            raise EngineError(f"seed must be an int or None, got {sampling.seed!r}")

    def _resolve_slot(self, slot: Slot) -> int | None:
        return self.active.bind(
            slot if slot in (ACTIVE, None) else check_slot(slot, len(self.slots))
        )

    def _version(self, slot: int | None) -> int:
        weights = self.slots[slot] if slot is not None else None
        return weights.version if weights is not None else self.base_version

    def pop_finished(self) -> list[tuple[int, Completion]]:
        """(request id, completion) of every request finished since the last call."""
        out, self._finished = self._finished, []
        return out

    def has_work(self) -> bool:
        return (
            not self.paused
            and not self.released
            and bool(self.scheduler.running or self.scheduler.waiting)
        )

    def step_work(self) -> int:
        """The next step's rows times the model's weights: whether lent threads pay (options)."""
        queued = len(self.scheduler.running) + len(self.scheduler.waiting)
        return min(self.scheduler.max_running, queued) * self.weights

    def run_until_idle(self) -> list[tuple[int, Completion]]:
        """Step until nothing can run (tests and scripts; the process interleaves commands
        instead)."""
        while self.has_work():
            self.step()
        return self.pop_finished()

    # ---- the step ------------------------------------------------------------------------------

    def step(self) -> None:
        if not self.has_work():
            return
        t0 = time.perf_counter()
        with torch.inference_mode():
            admitted = self.scheduler.admit()
            if admitted:
                self._prefill(admitted)
            if self.scheduler.running:
                self._decode()
        self.counters["busy_s"] += time.perf_counter() - t0

    def _project(self, slots: list[int | None], tokens_per_row: int) -> Project:
        """The adapter application for a batch whose row i is bound to slots[i]."""
        batch = self._slot_batch(slots, tokens_per_row)
        return plain_linear if batch is None else batch.project

    def _head(self, slots: list[int | None]) -> HeadDelta | None:
        """What a LoRA on the output projection adds to the logits of row i (slot slots[i])."""
        batch = self._slot_batch(slots, 1)
        return None if batch is None else batch.head()

    def _slot_batch(self, slots: list[int | None], tokens_per_row: int) -> SlotBatch | None:
        present = sorted({s for s in slots if s is not None})
        if not present:
            return None
        entries = []
        device = self.decoder.device
        for s in present:
            rows = [i for i, x in enumerate(slots) if x == s]
            idx = None
            if len(rows) < len(slots):  # a mixed batch: this slot touches only its rows' tokens
                idx = (
                    torch.tensor(rows, device=device)[:, None] * tokens_per_row
                    + torch.arange(tokens_per_row, device=device)
                ).reshape(-1)
            weights = self.slots[s]
            assert weights is not None  # a request is bound only to a loaded slot (serving.py)
            entries.append((weights, idx))
        return SlotBatch(entries)

    def _prefix_key(self, seq: Sequence) -> PrefixKey:
        return (seq.slot, self._version(seq.slot), self.base_version, tuple(seq.prompt_ids))

    def _prefill(self, admitted: list[Sequence]) -> None:
        """KV and first token for newly admitted rows; identical prompts are computed once."""
        now = time.time()
        logits: list[torch.Tensor | None] = [None] * len(admitted)
        compute: list[int] = []  # indices into admitted that need a forward
        keys: dict[int, PrefixKey] = {}
        first_of: dict[PrefixKey, int] = {}
        # (index, index of the identical prompt computed in this batch)
        copies: list[tuple[int, int]] = []
        for j, seq in enumerate(admitted):
            if seq.version_start is None:
                seq.version_start, seq.t_start = self._version(seq.slot), now
            # recompute prompt + output so far, never from the cache; and a prompt whose logprobs
            # are asked for is run whole (the cache keeps the last position's logits only)
            if seq.retracted or self._scores_prompt(seq):
                compute.append(j)
                continue
            key = keys[j] = self._prefix_key(seq)
            if key in first_of:
                copies.append((j, first_of[key]))
                continue
            entry = self.cache.get(key)
            if entry is not None:
                self.pool.load(seq.row, entry.kv)
                logits[j] = entry.logits
                continue
            first_of[key] = j
            compute.append(j)
        if compute:
            out = self._forward_prefill([admitted[j] for j in compute])
            for row_logits, j in zip(out, compute, strict=True):
                logits[j] = row_logits
                if j in keys:
                    seq = admitted[j]
                    entry = PrefixEntry(
                        self.pool.export(seq.row, seq.num_tokens), row_logits.clone()
                    )
                    self.cache.put(keys[j], entry)
        for j, src in copies:
            self.pool.move(admitted[src].row, admitted[j].row, admitted[j].num_tokens)
            logits[j] = logits[src]
            self.cache.hits += 1
        self._advance(admitted, torch.stack(logits))  # type: ignore[arg-type]

    def _forward_prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """One padded forward over whole sequences; writes their KV rows; last-position logits."""
        device = self.decoder.device
        lengths = [s.num_tokens for s in seqs]
        width = max(lengths)
        tokens = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            tokens[i, : lengths[i]] = torch.tensor(s.tokens)
        rows = torch.tensor([s.row for s in seqs], device=device)
        hidden = self.decoder.prefill(
            tokens.to(device),
            self._project([s.slot for s in seqs], width),
            store=lambda layer, k, v: self.pool.store_prefill(rows, layer, k, v),
        )
        last = hidden[
            torch.arange(len(seqs), device=device), torch.tensor(lengths, device=device) - 1
        ]
        logits = self.decoder.logits(last, self._head([s.slot for s in seqs]))
        self.counters["prefill_tokens"] += sum(lengths)
        for i, seq in enumerate(seqs):
            if self._scores_prompt(seq):
                self._score_prompt(seq, hidden[i, : len(seq.prompt_ids) - 1])
        return logits

    @staticmethod
    def _scores_prompt(seq: Sequence) -> bool:
        asked = seq.sampling.prompt_logprobs >= 0 or seq.sampling.prompt_targets is not None
        return asked and seq.prompt_logprobs is None

    def _score_prompt(self, seq: Sequence, hidden: torch.Tensor) -> None:
        """The prompt's logprobs (and top-k) from its prefill's hidden states: position i predicts
        prompt[i + 1], at temperature 1, through the request's slot."""
        k = max(seq.sampling.prompt_logprobs, 0)
        seq.prompt_logprobs, seq.prompt_top = [None], [[]] if k else None
        if seq.sampling.prompt_targets is not None:
            seq.prompt_target_logprobs = []
        if hidden.shape[0] == 0:
            return
        logp = torch.log_softmax(
            self.decoder.logits(hidden, self._head([seq.slot] * hidden.shape[0])), dim=-1
        )
        targets = torch.tensor(seq.prompt_ids[1:], device=logp.device)
        seq.prompt_logprobs += logp.gather(1, targets[:, None])[:, 0].tolist()
        if seq.sampling.prompt_targets is not None:
            seq.prompt_target_logprobs = gather_rows(logp, seq.sampling.prompt_targets)
        if k:
            top = logp.topk(min(k, logp.shape[-1]), dim=-1)
            for ids, values in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                seq.prompt_top.append(list(zip(ids, values, strict=True)))  # type: ignore[union-attr]

    def _decode(self) -> None:
        running = list(self.scheduler.running)
        device = self.decoder.device
        tokens = torch.tensor([s.output_ids[-1] for s in running], device=device)
        positions = torch.tensor([s.num_tokens - 1 for s in running], device=device)
        kv_len = max(s.num_tokens for s in running)
        hidden = self.decoder.decode(
            tokens,
            positions,
            self.pool.k,
            self.pool.v,
            kv_len,
            self._project([s.slot for s in running], 1),
        )
        self._advance(running, self.decoder.logits(hidden, self._head([s.slot for s in running])))

    def _advance(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Sample one token per row, record it, retire the rows that finished."""
        tokens, logprobs = sample(logits, [s.sampling for s in seqs], [s.generator for s in seqs])
        for i, seq in enumerate(seqs):
            if seq.sampling.output_top:
                seq.output_top.append(top_logprobs(logits[i], seq.sampling))
        self.counters["tokens_generated"] += len(seqs)
        done = []
        for seq, token, logprob in zip(seqs, tokens, logprobs, strict=True):
            reason = seq.append(token, logprob, self.max_context)
            if reason is not None:
                done.append((seq, reason))
        if done:
            self._retire(done)

    def _retire(self, done: list[tuple[Sequence, FinishReason]]) -> None:
        """Finish running sequences, compacting the KV rows."""
        for src, dst, length in self.scheduler.remove([s for s, _ in done]):
            self.pool.move(src, dst, length)
        for seq, reason in done:
            self._complete(seq, reason)

    def _complete(self, seq: Sequence, reason: FinishReason) -> None:
        if reason == "abort":
            self.counters["aborted"] += 1
        self._finished.append(
            (
                seq.rid,
                seq.completion(
                    reason, self._version(seq.slot), self._version(seq.slot), time.time()
                ),
            )
        )

    # ---- control calls -------------------------------------------------------------------------

    def load_adapter(
        self, slot: int, tensors: dict[str, torch.Tensor], adapter_config: dict, version: int
    ) -> float:
        """Write a peft adapter into a slot; the other slot keeps serving meanwhile. Returns the
        write time.

        Everything is validated and built first (EngineError leaves the slot as it was). Then, if
        generation is running, requests running on this slot are aborted (never write under a
        running request); if paused, they keep their binding and continue on the new contents.
        """
        slot = check_slot(slot, len(self.slots))
        check_version(version)
        weights = parse_adapter(
            tensors,
            adapter_config,
            version,
            self.spec,
            self.decoder.dtype,
            # validates everything; raises before any change
            self.decoder.device,
        )
        if not self.paused:
            victims = [s for s in self.scheduler.running if s.slot == slot]
            if victims:
                self.counters["aborted_on_load"] += len(victims)
                self._retire([(s, "abort") for s in victims])
        self.slots[slot] = weights
        self.cache.drop_slot(slot)
        return time.time()

    def activate(self, slot: int | None) -> None:
        """New ACTIVE requests bind to `slot` (None = base weights). Moves no tensors."""
        self.active.set(None if slot is None else check_slot(slot, len(self.slots)))

    def pause_generation(self, mode: str = "in_place") -> None:
        """Stop stepping. in_place: running requests keep rows and KV; retract: their KV is dropped
        and they are re-prefilled (prompt + output so far) on continue; abort: running and waiting
        requests finish with reason "abort". Requests submitted while paused wait."""
        check_pause_mode(mode)
        if not self.paused:
            self.paused, self._pause_t0 = True, time.perf_counter()
        if mode == "retract":
            self._retract()
        elif mode == "abort":
            for seq in self.scheduler.take_running() + self.scheduler.take_waiting():
                self._complete(seq, "abort")

    def _retract(self) -> None:
        """Drop running requests' KV; they wait at the head of the queue to be recomputed."""
        seqs = self.scheduler.take_running()
        for seq in reversed(seqs):
            self.scheduler.add(seq, front=True)
        self.counters["retracted"] += len(seqs)

    def continue_generation(self) -> None:
        if self.paused:
            self.counters["paused_s"] += time.perf_counter() - self._pause_t0
            self.paused = False

    def flush_cache(self) -> None:
        """Drop every prefix-cache entry (allowed in any state; running KV is untouched)."""
        self.cache.clear()

    def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Full-weight push by HF names. Running requests continue on the new weights."""
        check_version(version)
        params = validate_weights(self.decoder, tensors)
        with torch.inference_mode():
            for name, t in tensors.items():
                params[name].copy_(t)
        self.base_version = version
        self.cache.clear()

    def release_memory(self) -> None:
        """Free the KV pool and prefix cache (running requests are retracted); on CUDA, weights go
        to CPU."""
        if self.released:
            return
        self._retract()
        self.pool.free()
        self.cache.clear()
        if self.decoder.device.type != "cpu":
            self._move(torch.device("cpu"))
            torch.cuda.empty_cache()
        self.released = True

    def resume_memory(self) -> None:
        if not self.released:
            return
        device = torch.device(self.options.device)
        if device != self.decoder.device:
            self._move(device)
        self.pool.device = self.decoder.device
        self.pool.allocate()
        self.released = False

    def _move(self, device: torch.device) -> None:
        self.decoder.to(device)
        self.slots = [None if w is None else w.to(device) for w in self.slots]

    def stats(self) -> EngineStats:
        c = self.counters
        paused_s = c["paused_s"] + (time.perf_counter() - self._pause_t0 if self.paused else 0.0)
        return EngineStats(
            tokens_generated=int(c["tokens_generated"]),
            busy_s=c["busy_s"],
            paused_s=paused_s,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            prefix_cache_entries=len(self.cache),
            prefix_cache_hits=self.cache.hits,
            active_slot=self.active.get(),
            slot_versions=tuple(None if w is None else w.version for w in self.slots),
            slot_requests=tuple(
                sum(1 for q in (*self.scheduler.running, *self.scheduler.waiting) if q.slot == i)
                for i in range(len(self.slots))
            ),
            base_version=self.base_version,
            paused=self.paused,
            prefill_tokens=int(c["prefill_tokens"]),
            aborted=int(c["aborted"]),
            aborted_on_load=int(c["aborted_on_load"]),
            retracted=int(c["retracted"]),
            threads=torch.get_num_threads(),  # the loop's thread: the one that computes
        )

    def shutdown(self) -> None:
        """Finish everything with reason abort."""
        for seq in self.scheduler.take_running() + self.scheduler.take_waiting():
            self._complete(seq, "abort")
