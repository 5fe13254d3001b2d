"""The service behind the Tinker routes: tenants' sessions, training clients on the served bases,
sampling sessions on the engines, checkpoints on disk, all of it recorded in the store (store.py).
app.py turns the wire into these calls; every call that does work returns a future (futures.py) at
once. A tenant's sessions, training runs and checkpoints as the RestClient lists them, and export
downloads, are listings.py's.

Every call names its tenant (keys.py): what belongs to another tenant is not found, whatever its
name. Names, as the SDK builds and parses them: a training client is `{session}:train:{n}` (the
SDK computes it when it loads a checkpoint into a new client), a sampling session
`{session}:sample:{k}`, a checkpoint `tinker://{client}/{weights|sampler_weights}/{name}` (in
DIR/checkpoints/ under the same three parts).

A restart (store.recover): futures that were running fail with the reason, training clients are
lost (their adapters lived in this process; `create_training_client_from_state` makes one again
from a checkpoint), and checkpoints and sampling sessions are as they were.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orbit.engine.base import SamplingParams
from orbit.host.threads import helper_thread
from orbit.serve import exports, provenance, search, wire
from orbit.serve.bases import Base, Bases, Engines
from orbit.serve.bodies import CopyWeights
from orbit.serve.checkpoints import Checkpoint, Checkpoints, expiry
from orbit.serve.clients import (
    AdamParams,
    LoraSpec,
    Request,
    Scored,
    TrainingClient,
    forward_backward_checked,
)
from orbit.serve.futures import Busy, Futures, Gone, NotFound, Record, Refused, RequestFailed
from orbit.serve.listings import Listings
from orbit.serve.samplers import Stops, onto
from orbit.serve.sampling_sessions import SamplingSessions, sampler_id, session_of
from orbit.serve.store import ClientRow, SessionRow, Store
from orbit.serve.training import Packable, Turns
from orbit.serve.wire import Sampled

log = logging.getLogger(__name__)
# A pack's bound in tokens (training.py). Each request of a pack is answered when the whole pack is
# done: 8 RL-shaped clients (252 tokens a request) packed 4 at a time trained 1.29x the tokens a
# second of one request a pass with a lower p99 latency; 16 at a time (8192) as fast as one a pass,
# and a p99 1.5-1.8x (bench/investigations/service.md, "orbit serve under load")
PACK_TOKENS = 1024
SAMPLES_KEPT = 4096  # samples' requests remembered for resends (service.sample)
COPY_WAIT_S = 300.0  # how long a copy_weights waits for its turn on the trainer's thread and runs
RESTARTED = "orbit serve restarted while this request ran, so it did not finish: send it again"


@dataclass(frozen=True)
class Quotas:
    """What one tenant may hold at once: live training clients, and requests waiting or running;
    and how long a session without a heartbeat keeps its clients (the SDK beats every 10 s)."""

    max_clients: int = 16
    max_queued: int = 256
    session_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not self.session_timeout_s > 0:  # NaN too
            raise ValueError(f"session_timeout_s: {self.session_timeout_s}; more than 0")


class Service:
    """The base models `served` (bases.py: each its engines and the trainer's copy of its weights),
    and the state of every tenant's clients, in `store`; checkpoints under `directory`; `threads`:
    the trainer's torch threads (one trainer thread runs every base's requests, in turns)."""

    def __init__(
        self,
        served: list[Engines],
        directory: Path,
        store: Store,
        quotas: Quotas = Quotas(),
        threads: int = 1,
        pack_tokens: int = PACK_TOKENS,
    ) -> None:
        self.bases = Bases(served)
        self.directory, self.store, self.quotas = directory, store, quotas
        self.futures = Futures(store)
        self.turns = Turns(threads, pack_tokens, self._run_pack)
        self.trainers: dict[str, TrainingClient] = {}  # the live clients' adapters
        self.checkpoints = Checkpoints(directory / "checkpoints", store, str(self.bases[0].model))
        self.listings = Listings(store, self.checkpoints, exports.Links(directory / "link-secret"))
        self.sessions = SamplingSessions(
            directory / "snapshots", store, self.checkpoints, self.bases
        )
        self._lock = threading.Lock()
        self._adapters = 0
        # the newest samples' requests by (tenant, session, seq_id), for the SDK's resends
        self._samples: OrderedDict[tuple[str, str, int | None], Record] = OrderedDict()
        self._copies: OrderedDict[tuple[str, str], Record] = OrderedDict()  # by idempotency key
        # they load adapters into engine slots (tensor copies): helpers, so that the trainer's
        # OpenMP team stays the process's only one (orbit/host/threads.py)
        self._sampling = ThreadPoolExecutor(
            8, thread_name_prefix="orbit-serve-sample", initializer=helper_thread
        )
        self.recovered = store.recover(RESTARTED)  # (futures failed, clients lost)
        self.checkpoints.reconcile()
        self._stopping = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="orbit-serve-reaper", daemon=True)
        self._reaper.start()

    def close(self) -> None:
        self._stopping.set()
        self._reaper.join(10)
        self.turns.stop()
        self._sampling.shutdown(wait=False, cancel_futures=True)

    # -- sessions ---------------------------------------------------------------------------

    def create_session(
        self,
        tenant: str,
        metadata: dict[str, Any],
        tags: list[str] | None = None,
        display_name: str | None = None,
    ) -> str:
        session = uuid.uuid4().hex[:16]
        now = time.time()
        row = SessionRow(
            id=session,
            tenant=tenant,
            user_metadata=metadata,
            created=now,
            seen=now,
            tags=tags or [],
            display_name=display_name,
        )
        self.store.add_session(row)
        return session

    def _session(self, tenant: str, session: str) -> SessionRow:
        """The tenant's session, while it lasts (Gone once it ended)."""
        row = self.store.session(session)
        if row is None or row.tenant != tenant:
            raise NotFound(f"no session {session!r}")
        if row.ended is not None:
            raise Gone(f"session {session!r} ended: {row.end_reason}")
        return row

    def heartbeat(self, tenant: str, session: str) -> None:
        self._session(tenant, session)
        self.store.seen(session)

    def finish_session(
        self, tenant: str, session: str, finish: str | None, detail: str | None = None
    ) -> None:
        """Its client finished the session (`finish`: success, errored or interrupted, as
        ServiceClient.close says; None: it said none): its training clients and sampling sessions
        are released, after the request the trainer is running (their saved checkpoints stay).
        Again, or after it ended: nothing more (the first reason stays)."""
        row = self.store.session(session)
        if row is None or row.tenant != tenant:
            raise NotFound(f"no session {session!r}")
        why = f"finished by its client ({finish or 'no reason'})"
        self.store.end_session(session, why, finish, detail)
        self._release_ended_soon()

    def _release_ended_soon(self) -> None:
        """Release what this instance holds of ended sessions, on the trainer's thread (the shared
        base changes there only), next."""
        record = Record(f"release-{uuid.uuid4().hex[:8]}", "Release", False, "")
        self.turns.run_now(record, self._release_ended)

    def _release_ended(self) -> None:
        for model_id, why in self.store.ended_clients():
            self._release(model_id, f"its session ended: {why}")
        self.sessions.release(self.store.ended_samplers())

    def _reap(self) -> None:
        """End the sessions whose heartbeat stopped `quotas.session_timeout_s` ago, and release
        what this instance holds of ended ones (another instance may have ended them: a shared
        database), and delete the recorded sequences unused for a day. The quotas are read each
        round: they may change while the service runs."""
        while not self._stopping.wait(min(5.0, self.quotas.session_timeout_s / 4)):
            timeout = self.quotas.session_timeout_s
            try:
                self.checkpoints.expire()
                self.store.purge_recorded(time.time() - provenance.KEEP_S)
                for session in self.store.silent_sessions(time.time() - timeout):
                    self.store.end_session(session, f"no heartbeat for {timeout:g} s")
                if self.store.ended_clients() or self.store.ended_samplers():
                    self._release_ended_soon()
            except Exception:  # noqa: BLE001 - a round that failed (the database, say) is retried
                log.exception("ending silent sessions failed; trying again")

    # -- training clients -------------------------------------------------------------------

    def _room(self, tenant: str) -> None:
        """Busy when the tenant has its most requests waiting or running."""
        if self.futures.pending(tenant) >= self.quotas.max_queued:
            raise Busy(
                f"this key has {self.quotas.max_queued} requests waiting or running "
                "(orbit serve --max-queued): wait for some to finish"
            )

    def _new(self, tenant: str, kind: str, proto: bool = False) -> Record:
        self._room(tenant)
        return self.futures.new(kind, tenant, proto)

    def create_model(
        self,
        tenant: str,
        session: str,
        seq: int,
        base_model: str,
        spec: LoraSpec,
        metadata: dict[str, Any],
    ) -> Record:
        self._session(tenant, session)
        self.bases.named(base_model).limits.check(spec)
        model_id = f"{session}:train:{seq}"
        if model_id not in self.trainers:
            self._client_room(tenant)
        record = self._new(tenant, "CreateModel")

        def work() -> dict[str, Any]:
            self._add_client(tenant, model_id, session, base_model, spec, metadata)
            return {"model_id": model_id, "type": "create_model"}

        return self.turns.run_now(record, work)

    def _client_room(self, tenant: str) -> None:
        if self.store.live_clients(tenant) >= self.quotas.max_clients:
            raise Busy(
                f"this key holds {self.quotas.max_clients} training clients "
                "(orbit serve --max-clients): no more at once"
            )

    def _add_client(
        self,
        tenant: str,
        model_id: str,
        session: str,
        base_model: str,
        spec: LoraSpec,
        metadata: dict[str, Any],
    ) -> TrainingClient:
        ended = self.store.session(session)
        if ended is not None and ended.ended is not None:  # it ended while this request waited
            raise Gone(f"session {session!r} ended: {ended.end_reason}")
        with self._lock:
            if model_id in self.trainers:  # a resubmission: the client exists
                return self.trainers[model_id]
        taken = self.store.client(model_id)
        if taken is not None:  # a copy's run, or a client lost in a restart: not made again
            why = taken.end_reason or "was lost when orbit serve restarted"
            raise Refused(f"model_seq_id: the session's run {model_id!r} exists; it {why}")
        with self._lock:
            self._adapters += 1
            name = f"c{self._adapters}"
        trainer = TrainingClient(model_id, name, self.bases.named(base_model).shared, spec)
        row = client_row(self.store.instance, tenant, model_id, base_model, spec, metadata)
        self.store.add_client(row)
        with self._lock:
            self.trainers[model_id] = trainer
        self.turns.open(model_id)
        return trainer

    def _client_row(self, tenant: str, model_id: str) -> ClientRow:
        row = self.store.client(model_id)
        if row is None or row.tenant != tenant:
            raise NotFound(f"no training client {model_id!r}")
        return row

    def client(self, tenant: str, model_id: str) -> TrainingClient:
        """The tenant's live training client; NotFound when there is none, or it was lost in a
        restart (the message names its newest saved state)."""
        row = self._client_row(tenant, model_id)
        with self._lock:
            trainer = self.trainers.get(model_id)
        if trainer is None:
            again = (
                f"its newest saved state is {row.last_state} (create_training_client_from_state)"
                if row.last_state
                else "it saved no state"
            )
            if row.end_reason:
                raise Gone(f"training client {model_id!r} {row.end_reason}; {again}")
            raise NotFound(
                f"training client {model_id!r} was lost when orbit serve restarted (its adapter "
                f"lived in memory); {again}"
            )
        self.store.touch_client(model_id)
        return trainer

    def unload_model(self, tenant: str, model_id: str) -> Record:
        """Release a training client after the requests it queued (its saved checkpoints stay)."""

        def work() -> dict[str, Any]:
            self._release(model_id, "unloaded (unload_model)")
            return {"model_id": model_id, "type": "unload_model"}

        return self._ordered(tenant, model_id, 0, "UnloadModel", work)

    def _release(self, model_id: str, why: str) -> None:
        """On the trainer's thread: the client's row ended with `why`, its queue closed, its
        adapter and optimizer freed."""
        self.store.end_client(model_id, why)
        with self._lock:
            trainer = self.trainers.pop(model_id, None)
        self.turns.close(model_id, f"training client {model_id!r} {why}")
        if trainer is not None:
            trainer.base.remove(trainer.name)

    def live(self) -> dict[str, TrainingClient]:
        """Every live training client, by id."""
        with self._lock:
            return dict(self.trainers)

    def info(self, tenant: str, model_id: str) -> dict[str, Any]:
        row = self._client_row(tenant, model_id)
        if row.end_reason:  # released: as every other call to it
            self.client(tenant, model_id)
        base = self.bases.named(row.base_model)
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_data": {
                "arch": base.shared.base.config.model_type,
                "model_name": row.base_model,
                "tokenizer_id": str(base.model),
            },
            "is_lora": True,
            "lora_rank": row.rank,
            "model_name": row.base_model,
        }

    def _ordered(
        self, tenant: str, model_id: str, seq_id: int, kind: str, work, proto: bool = False
    ) -> Record:
        """Queue `work` in the client's order (a refused request is never queued: the ones after
        it do not wait for its number)."""
        self.client(tenant, model_id)
        record = self._new(tenant, kind, proto)
        try:
            return self.turns.submit(model_id, seq_id, record, work)
        except RequestFailed as err:  # released meanwhile, or behind a request that ran
            record.future.set_exception(err)
            self.client(tenant, model_id)  # Gone, naming why, if it was released
            raise Refused(str(err)) from None

    def forward_backward(self, tenant: str, request: wire.ForwardBackward) -> Record:
        trainer = self.client(tenant, request.model_id)
        data, metrics = request.data, {}
        if request.loss_fn == "stable_reinforce":  # the recorded sequences the datums name
            row = self.store.client(request.model_id)
            session, base = (row.session, row.base_model) if row is not None else ("", "")
            on_base = lambda b: self.bases.same(b, base)  # noqa: E731
            data, diff = provenance.resolve(data, tenant, session, self.store.recorded, on_base)
            metrics[provenance.DIFF_METRIC] = diff
        else:
            provenance.check_tiling(data)
        trainer.check(data, request.loss_fn, request.config)  # a 4xx before it queues

        def answer(scored: Scored) -> bytes:
            return wire.forward_backward_output(
                scored.logprobs, {"loss:sum": scored.loss, **metrics}
            )

        asked = Request(trainer, data, request.loss_fn, request.config, request.forward_only)
        kind = "Forward" if request.forward_only else "ForwardBackward"
        work = Packable(kind, asked.tokens(), asked, answer)
        return self._ordered(tenant, request.model_id, request.seq_id, kind, work, proto=True)

    def _run_pack(self, requests: list[Request]) -> list[Scored | Exception]:
        """A pack's requests, a pass over each base they are on (one pass when they share one);
        a pass that fails fails its own requests only (the others' gradients are in)."""
        answers: list[Scored | Exception] = [RuntimeError("on no served base")] * len(requests)
        for base in self.bases:
            mine = [i for i, r in enumerate(requests) if r.client.base is base.shared]
            if not mine:
                continue
            try:
                done: list = forward_backward_checked(base.shared, [requests[i] for i in mine])
            except Exception as err:  # noqa: BLE001 - the pass's failure is its requests' answer
                done = [err] * len(mine)
            for i, answer in zip(mine, done, strict=True):
                answers[i] = answer
        return answers

    def optim_step(self, tenant: str, model_id: str, seq_id: int, adam: AdamParams) -> Record:
        trainer = self.client(tenant, model_id)
        adam.check()

        def work() -> dict[str, Any]:
            return {"metrics": trainer.optim_step(adam), "type": "optim_step"}

        return self._ordered(tenant, model_id, seq_id, "OptimStep", work)

    # -- checkpoints ------------------------------------------------------------------------

    def save_state(
        self,
        tenant: str,
        model_id: str,
        seq_id: int,
        name: str,
        overwrite: bool,
        ttl_seconds: int | None = None,
        metadata: dict[str, str] | None = None,
    ) -> Record:
        trainer = self.client(tenant, model_id)
        self.checkpoints.directory(model_id, "weights", name)  # a name it refuses: now
        expiry(ttl_seconds, 0.0)  # a TTL it refuses: now

        def work() -> dict[str, Any]:
            save = lambda d: trainer.save(d, True)  # noqa: E731 - adapter and optimizer
            path = self.checkpoints.save(
                tenant, model_id, "weights", name, save, overwrite, ttl_seconds, metadata
            )
            self.store.touch_client(model_id, last_state=path)
            return {"path": path, "type": "save_weights"}

        return self._ordered(tenant, model_id, seq_id, "SaveWeights", work)

    def save_for_sampler(
        self,
        tenant: str,
        model_id: str,
        seq_id: int,
        name: str | None,
        sampling_seq: int | None,
        kind: str = "snapshot",
        ttl_seconds: int | None = None,
        metadata: dict[str, str] | None = None,
    ) -> Record:
        """Named: a persistent sampler checkpoint (with its TTL and metadata). Unnamed: a sampling
        session on the adapter as it is now, fixed (`kind` "snapshot") or the training client's
        inflight target, which later inflight saves update for every session on it
        (sampling_sessions.py); it lasts as long as its session, so it takes no TTL."""
        trainer = self.client(tenant, model_id)
        row = self._client_row(tenant, model_id)
        session, base = row.session, row.base_model
        if name is not None:
            self.checkpoints.directory(model_id, "sampler_weights", name)
            expiry(ttl_seconds, 0.0)
        elif ttl_seconds is not None or metadata:
            field = "ttl_seconds" if ttl_seconds is not None else "user_metadata"
            raise Refused(f"{field}: an unnamed sampler's weights last as long as its session")
        if kind not in ("snapshot", "inflight"):
            raise Refused(f"kind: {kind!r}; snapshot or inflight")

        def work() -> dict[str, Any]:
            if name is not None:
                save = lambda d: trainer.save(d, False)  # noqa: E731 - the adapter alone
                path = self.checkpoints.save(
                    tenant, model_id, "sampler_weights", name, save, True, ttl_seconds, metadata
                )
                return {"path": path}
            sampler = sampler_id(session, sampling_seq if sampling_seq is not None else 0)
            if kind == "inflight":
                self.sessions.publish(tenant, sampler, trainer, base, self._sampling)
            else:
                self.sessions.snapshot(tenant, sampler, trainer, base)
            return {"sampling_session_id": sampler, "type": "save_weights_for_sampler"}

        return self._ordered(tenant, model_id, seq_id, "SaveWeightsForSampler", work)

    def save_external(
        self,
        tenant: str,
        model_id: str,
        seq_id: int,
        name: str,
        ttl_seconds: int | None = None,
        age_recipients: list[str] | None = None,
    ) -> Record:
        """The adapter as external weights, for download (exports.py): peft's files, encrypted to
        `age_recipients` when any are named; a save under the same name replaces the last."""
        trainer = self.client(tenant, model_id)
        self.checkpoints.directory(model_id, "external_weights", name)
        expiry(ttl_seconds, 0.0)
        to = exports.recipients(age_recipients)

        def fill(directory: Path) -> None:
            trainer.save(directory, False)
            if to:
                exports.encrypt(directory, to)

        def work() -> dict[str, Any]:
            path = self.checkpoints.save(
                tenant, model_id, "external_weights", name, fill, True, ttl_seconds
            )
            return {"path": path, "type": "save_weights_external"}

        return self._ordered(tenant, model_id, seq_id, "SaveWeightsExternal", work)

    def checkpoint(self, tenant: str, path: str) -> Checkpoint:
        return self.checkpoints.get(tenant, path)

    def delete_checkpoint(self, tenant: str, path: str) -> None:
        self.checkpoints.delete(tenant, path)
        self.bases.forget(path)

    def copy_weights(self, tenant: str, req: CopyWeights, key: str | None) -> dict[str, Any]:
        """RestClient.copy_weights: a checkpoint (the tenant's, or published) copied to a new
        training run of the tenant's, which cannot be trained on: `{session}:train:{model_seq_id}`
        in a session of the tenant's, or a run of its own in the tenant's one project. On the
        trainer's thread, where saves run, so no save of the same name is copied half old, half
        new; `key`: the SDK's X-Idempotency-Key (a retry waits for the first copy's answer)."""
        with self._lock:
            again = self._copies.get((tenant, key)) if key else None
        if again is not None:
            return _waited(again, COPY_WAIT_S)
        if req.session_id is not None:
            self._session(tenant, req.session_id)
            if req.model_seq_id is None:
                raise Refused("model_seq_id: give it with session_id (the run's place)")
            run = f"{req.session_id}:train:{req.model_seq_id}"
            if self.store.client(run) is not None:
                raise Refused(f"model_seq_id: {req.model_seq_id}; the session has a run {run!r}")
        else:
            if req.destination_project_id is None:
                raise Refused("destination_project_id: give one, or session_id and model_seq_id")
            search.check_projects(tenant, [req.destination_project_id])
            run = f"copy-{uuid.uuid4().hex[:12]}:train:0"
        if req.ttl_seconds is not None and req.ttl_seconds < 3600:
            raise Refused(f"ttl_seconds: {req.ttl_seconds}; a copy lasts an hour (3600) or more")
        self.checkpoints.loadable(tenant, req.source_path)  # NotFound: now
        record = self._new(tenant, "CopyWeights")

        def work() -> dict[str, Any]:
            found = self.checkpoints.loadable(tenant, req.source_path)
            made_on, spec = self.checkpoints.made_with(found)
            row = client_row(self.store.instance, tenant, run, made_on, spec, {})
            row.alive = False
            row.end_reason = f"holds a copy of {req.source_path}: it cannot be trained on"
            path = self.checkpoints.copy(tenant, found, run, req.ttl_seconds)
            self.store.add_client(row)  # after: a copy that failed leaves no run behind
            return {"tinker_path": path}

        if key:
            with self._lock:
                self._copies[(tenant, key)] = record
                while len(self._copies) > SAMPLES_KEPT:
                    self._copies.popitem(last=False)
        return _waited(self.turns.run_now(record, work), COPY_WAIT_S)

    def publish_checkpoint(self, tenant: str, path: str, public: bool) -> None:
        self.checkpoints.publish(tenant, path, public)

    def set_checkpoint_ttl(self, tenant: str, path: str, ttl_seconds: int | None) -> None:
        self.checkpoints.set_ttl(tenant, path, ttl_seconds)

    def load_state(
        self,
        tenant: str,
        path: str,
        optimizer: bool,
        model_id: str | None = None,
        seq_id: int = 0,
        session: str | None = None,
        seq: int | None = None,
        base_model: str | None = None,
        metadata: dict[str, str] | None = None,
    ) -> Record:
        """Into an existing client (`model_id`, in its order), or a new one `{session}:train:{seq}`
        made as the checkpoint's was, with `metadata` (`base_model`, when given, must be the
        checkpoint's)."""
        if model_id is not None:
            trainer = self.client(tenant, model_id)
            if metadata:
                raise Refused("user_metadata: given when a client is made from a checkpoint")
            self._fits(trainer, self._loadable(tenant, path, optimizer))
            return self._ordered(
                tenant,
                model_id,
                seq_id,
                "LoadWeights",
                lambda: self._load(tenant, trainer, path, optimizer),
            )
        if session is None or seq is None:
            raise Refused("load_weights: give model_id, or session_id and model_seq_id")
        self._session(tenant, session)
        found = self._loadable(tenant, path, optimizer)
        made_on, spec = self.checkpoints.made_with(found)
        if base_model is not None and not self.bases.same(base_model, made_on):
            raise Refused(f"base_model {base_model[:200]!r}: {path} was made on another model")
        self.bases.named(made_on).limits.check(spec)  # a base this orbit serve still serves
        base_model = made_on
        new_id = f"{session}:train:{seq}"
        if new_id not in self.trainers:
            self._client_room(tenant)
        record = self._new(tenant, "LoadWeights")

        def work() -> dict[str, Any]:
            trainer = self._add_client(tenant, new_id, session, base_model, spec, metadata or {})
            return self._load(tenant, trainer, path, optimizer)

        return self.turns.run_now(record, work)

    def _fits(self, trainer: TrainingClient, found: Checkpoint) -> None:
        """Refuse a checkpoint made on another base model than the client's, or whose LoRA is not
        the client's (rank, targets), naming both."""
        made_on, spec = self.checkpoints.made_with(found)
        row = self.store.client(trainer.model_id)
        if row is not None and not self.bases.same(made_on, row.base_model):
            raise Refused(
                f"{found.path}: made on another base model than this client's "
                f"({row.base_model[:200]}); create_training_client_from_state makes a client on "
                "the checkpoint's"
            )
        mine = trainer.spec
        shape = (spec.rank, spec.train_attn, spec.train_mlp, spec.train_unembed)
        if shape != (mine.rank, mine.train_attn, mine.train_mlp, mine.train_unembed):
            raise Refused(
                f"{found.path}: a LoRA of rank {spec.rank} on {spec.targets()}, not this client's "
                f"(rank {mine.rank} on {mine.targets()}): create_training_client_from_state makes "
                "a client of its shape"
            )

    def _loadable(self, tenant: str, path: str, optimizer: bool) -> Checkpoint:
        found = self.checkpoints.loadable(tenant, path)
        if optimizer and found.kind != "weights":
            raise Refused(f"{path}: a sampler's weights hold no optimizer state")
        return found

    def _load(
        self, tenant: str, trainer: TrainingClient, path: str, optimizer: bool
    ) -> dict[str, Any]:
        found = self._loadable(tenant, path, optimizer)
        self._fits(trainer, found)
        trainer.load(found.directory, optimizer)
        return {"path": found.path, "model_id": trainer.model_id, "type": "load_weights"}

    # -- sampling ---------------------------------------------------------------------------

    def create_sampler(
        self, tenant: str, session: str, seq: int, model_path: str | None, base_model: str | None
    ) -> str:
        self._session(tenant, session)
        sampler = sampler_id(session, seq)
        if model_path:
            found = self.checkpoints.loadable(tenant, model_path)
            base = self.checkpoints.made_with(found)[0]
        else:
            base = base_model or ""
        self.bases.named(base)  # one this orbit serve serves
        self.sessions.open(tenant, sampler, base, model_path)
        row = self.store.session(session)
        if row is not None and row.ended is not None:  # it ended meanwhile: not kept
            self.sessions.release(self.store.ended_samplers())
            self._session(tenant, session)
        return sampler

    def sampler_info(self, tenant: str, sampler: str) -> dict[str, Any]:
        return self.sessions.info(tenant, sampler)

    def sample(
        self,
        tenant: str,
        sampler: str,
        base: Base,
        prompt: list[int],
        params: SamplingParams,
        n: int,
        stops: Stops,
        seq_id: int | None = None,
        last_n: int | None = None,
        keep_sequences: bool = False,
        targets: wire.Targets | None = None,
    ) -> Record:
        """`n` samples of `prompt` from the session's weights, on `base` (the session's:
        `sampling_base`). A request the SDK sends again
        (the same session and `seq_id`: a retry after a lost answer) is the first one's future,
        not a second sample. `keep_sequences`: the sequences are recorded under their sequence_ids
        (`sequence_ids`) for stable_reinforce (orbit/serve/provenance.py). `targets`: the
        prompt's logprobs of those tokens too (`target_prompt_logprobs`)."""
        if targets is not None:
            params = dataclasses.replace(params, prompt_targets=targets.rows())
        weights = self.sessions.weights(tenant, sampler)
        base.check_prompt(prompt, params.max_new_tokens)
        if not 1 <= n <= 128:
            raise Refused(f"num_samples: {n}; from 1 to 128")
        key = (tenant, sampler, seq_id)
        with self._lock:
            again = self._samples.get(key) if seq_id is not None else None
        if again is not None:
            return again
        record = self._new(tenant, "Sample", proto=True)
        if seq_id is not None:
            with self._lock:
                self._samples[key] = record
                while len(self._samples) > SAMPLES_KEPT:
                    self._samples.popitem(last=False)
        submitted = self._sampling.submit(
            base.sampler.sample, weights, prompt, params, n, stops, last_n
        )
        keep = None
        if keep_sequences:

            def keep(sampled: Sampled) -> None:
                rows = provenance.records(
                    tenant,
                    session_of(sampler),
                    prompt,
                    provenance.sequence_ids(record.id, n),
                    sampled,
                    time.time(),
                    str(base.model),  # one of its names
                )
                self.store.add_recorded(rows)

        submitted.add_done_callback(lambda f: onto(f, record.future, keep, self._sampling, targets))
        return record

    def sampling_base(self, tenant: str, sampler: str) -> Base:
        """The base a tenant's sampling session samples."""
        return self.bases.named(self.sessions.info(tenant, sampler)["base_model"])

    def capabilities(self) -> dict[str, Any]:
        """The models served (RestClient.get_server_capabilities)."""
        return {"supported_models": self.bases.capabilities()}


def client_row(
    instance: str,
    tenant: str,
    model_id: str,
    base_model: str,
    spec: LoraSpec,
    metadata: dict[str, Any],
) -> ClientRow:
    """A training run's row, alive, as created now (`model_id`: `{session}:train:{n}`)."""
    now = time.time()
    return ClientRow(
        id=model_id,
        instance=instance,
        tenant=tenant,
        session=model_id.split(":")[0],
        base_model=base_model,
        rank=spec.rank,
        seed=spec.seed,
        train_attn=spec.train_attn,
        train_mlp=spec.train_mlp,
        train_unembed=spec.train_unembed,
        user_metadata=metadata,
        created=now,
        last_request=now,
        alive=True,
        last_state=None,
    )


def _waited(record: Record, timeout: float) -> Any:
    """A request run on the trainer's thread, answered in place (a route without a future): its
    result, or its failure as the refusal or the error it was."""
    try:
        return record.future.result(timeout)
    except TimeoutError:  # concurrent.futures' too (3.11)
        raise Busy(
            f"{record.kind}: not done after {timeout:g} s (the trainer is busy); it goes on: send "
            "it again with the same X-Idempotency-Key for its answer"
        ) from None
    except RequestFailed as err:
        if err.category == "user":
            raise Refused(str(err)) from None
        raise
