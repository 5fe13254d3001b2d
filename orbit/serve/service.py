"""The service behind the Tinker routes: sessions, training clients on the one base, sampling
sessions on the engines, checkpoints on disk. app.py turns the wire into these calls; every call
that does work returns a future (futures.py) at once.

Names, as the SDK builds and parses them: a training client is `{session}:train:{n}` (the SDK
computes it when it loads a checkpoint into a new client), a sampling session
`{session}:sample:{k}`, a checkpoint `tinker://{client}/{weights|sampler_weights}/{name}` (in
DIR/checkpoints/ under the same three parts).
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from orbit.engine.base import SamplingParams
from orbit.host.files import write_dir
from orbit.serve import wire
from orbit.serve.clients import AdamParams, LoraSpec, TrainingClient
from orbit.serve.futures import Futures, Record, Refused, RequestFailed
from orbit.serve.samplers import BASE, Sampler, Stops, Weights
from orbit.serve.training import Turns
from orbit.train.shared import SharedBase

KINDS = ("weights", "sampler_weights")  # a training checkpoint (adapter + optimizer), a sampler's


class NotFound(Refused):
    """A session, client, sampler or checkpoint that does not exist (HTTP 404)."""


@dataclass(frozen=True)
class EngineLimits:
    """What the engines can load into a slot: any LoRA rank on the embedded engine (None); up to the
    rank SGLang was started with (the recipe's adapter.r) on SGLang."""

    max_rank: int | None = None

    def check(self, spec: LoraSpec) -> None:
        if self.max_rank is not None and spec.rank > self.max_rank:
            raise Refused(
                f"lora_config.rank: {spec.rank}; these SGLang engines load LoRA ranks up to "
                f"{self.max_rank} (the recipe's adapter.r: serve with a higher one)"
            )


@dataclass
class Client:
    """A training client as the service knows it: its adapter and what the REST routes report."""

    trainer: TrainingClient
    session: str
    base_model: str
    metadata: dict[str, Any]
    last_request: float = field(default_factory=time.time)


@dataclass
class Checkpoint:
    path: str  # tinker://...
    directory: Path
    client: str
    kind: str
    name: str
    time: float


def checkpoint_path(client: str, kind: str, name: str) -> str:
    return f"tinker://{client}/{kind}/{name}"


def parse_path(path: str) -> tuple[str, str, str]:
    """(client, kind, name) of a tinker:// path; NotFound when it is not one Orbit writes."""
    parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in KINDS or not all(parts):
        raise NotFound(
            f"{path!r} is not a checkpoint path (tinker://<training run>/<weights|sampler_weights>/"
            "<name>)"
        )
    return parts[0], parts[1], parts[2]


class Service:
    """One base model (`model`, also known by the names in `names`), its engines (`sampler`), and
    the state of every client; checkpoints under `directory`."""

    def __init__(
        self,
        model: Path,
        names: set[str],
        sampler: Sampler,
        directory: Path,
        dtype: str = "float32",
        max_context: int = 4096,
        vocab_size: int = 0,
        limits: EngineLimits = EngineLimits(),
    ) -> None:
        self.model, self.names, self.sampler, self.limits = model, names, sampler, limits
        self.directory = directory
        self.max_context, self.vocab_size = max_context, vocab_size
        self.base = SharedBase(model, dtype)
        self.futures = Futures()
        self.turns = Turns()
        self.sessions: dict[str, dict[str, Any]] = {}
        self.clients: dict[str, Client] = {}
        self.samplers: dict[str, tuple[Weights, str | None]] = {}  # id -> (weights, model_path)
        self._lock = threading.Lock()
        self._adapters = itertools.count()
        self._sampling = ThreadPoolExecutor(8, thread_name_prefix="orbit-serve-sample")

    def close(self) -> None:
        self.turns.stop()
        self._sampling.shutdown(wait=False, cancel_futures=True)

    # -- sessions ---------------------------------------------------------------------------

    def create_session(self, metadata: dict[str, Any], owner: str = "") -> str:
        session = uuid.uuid4().hex[:16]
        with self._lock:
            self.sessions[session] = {"metadata": metadata, "owner": owner, "seen": time.time()}
        return session

    def heartbeat(self, session: str) -> None:
        with self._lock:
            if session not in self.sessions:
                raise NotFound(f"no session {session!r}")
            self.sessions[session]["seen"] = time.time()

    # -- training clients -------------------------------------------------------------------

    def check_base(self, base_model: str) -> None:
        if base_model not in self.names:
            served = " or ".join(sorted(self.names))
            raise Refused(f"base_model {base_model!r}: this orbit serve serves {served}")

    def create_model(
        self, session: str, seq: int, base_model: str, spec: LoraSpec, metadata: dict[str, Any]
    ) -> Record:
        self.check_base(base_model)
        self.limits.check(spec)
        model_id = f"{session}:train:{seq}"
        record = self.futures.new("CreateModel")

        def work() -> dict[str, Any]:
            self._add_client(model_id, session, base_model, spec, metadata)
            return {"model_id": model_id, "type": "create_model"}

        return self.turns.run_now(record, work)

    def _add_client(
        self, model_id: str, session: str, base_model: str, spec: LoraSpec, metadata: dict[str, Any]
    ) -> Client:
        with self._lock:
            if model_id in self.clients:  # a resubmission: the client exists
                return self.clients[model_id]
        trainer = TrainingClient(model_id, f"c{next(self._adapters)}", self.base, spec)
        client = Client(trainer, session, base_model, metadata)
        with self._lock:
            self.clients[model_id] = client
        self.turns.open(model_id)
        return client

    def client(self, model_id: str) -> Client:
        with self._lock:
            client = self.clients.get(model_id)
        if client is None:
            raise NotFound(f"no training client {model_id!r}")
        client.last_request = time.time()
        return client

    def info(self, model_id: str) -> dict[str, Any]:
        client = self.client(model_id)
        spec = client.trainer.spec
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_data": {
                "arch": self.base.base.config.model_type,
                "model_name": client.base_model,
                "tokenizer_id": str(self.model),
            },
            "is_lora": True,
            "lora_rank": spec.rank,
            "model_name": client.base_model,
        }

    def _ordered(self, model_id: str, seq_id: int, kind: str, work, proto: bool = False) -> Record:
        """Queue `work` in the client's order. What it refuses, it refuses in its turn (its future
        fails): the SDK numbered the request, and the ones after it wait for its number."""
        self.client(model_id)
        record = self.futures.new(kind, proto)
        return self.turns.submit(model_id, seq_id, record, work)

    def forward_backward(self, request: wire.ForwardBackward) -> Record:
        trainer = self.client(request.model_id).trainer

        def work() -> bytes:
            scored = trainer.forward_backward(
                request.data, request.loss_fn, request.config, request.forward_only
            )
            return wire.forward_backward_output(scored.logprobs, {"loss:sum": scored.loss})

        kind = "Forward" if request.forward_only else "ForwardBackward"
        return self._ordered(request.model_id, request.seq_id, kind, work, proto=True)

    def optim_step(self, model_id: str, seq_id: int, adam: AdamParams) -> Record:
        trainer = self.client(model_id).trainer

        def work() -> dict[str, Any]:
            return {"metrics": trainer.optim_step(adam), "type": "optim_step"}

        return self._ordered(model_id, seq_id, "OptimStep", work)

    # -- checkpoints ------------------------------------------------------------------------

    def _directory(self, client: str, kind: str, name: str) -> Path:
        if not name or "/" in name or name.startswith("."):
            raise Refused(
                f"checkpoint name {name!r}: a name without '/' that does not start with '.'"
            )
        return self.directory / "checkpoints" / client / kind / name

    def save_state(self, model_id: str, seq_id: int, name: str, overwrite: bool) -> Record:
        trainer = self.client(model_id).trainer

        def work() -> dict[str, Any]:
            directory = self._directory(model_id, "weights", name)
            self._write(directory, overwrite, lambda d: trainer.save(d, optimizer=True))
            return {"path": checkpoint_path(model_id, "weights", name), "type": "save_weights"}

        return self._ordered(model_id, seq_id, "SaveWeights", work)

    def save_for_sampler(
        self, model_id: str, seq_id: int, name: str | None, sampling_seq: int | None
    ) -> Record:
        """Named: a persistent sampler checkpoint. Unnamed: a snapshot of the adapter now, and a
        sampling session bound to it."""
        client = self.client(model_id)
        trainer = client.trainer

        def work() -> dict[str, Any]:
            if name is not None:
                directory = self._directory(model_id, "sampler_weights", name)
                self._write(directory, True, lambda d: trainer.save(d, optimizer=False))
                return {"path": checkpoint_path(model_id, "sampler_weights", name)}
            tensors, config = trainer.adapter()
            sampler = f"{client.session}:sample:{sampling_seq if sampling_seq is not None else 0}"
            with self._lock:
                self.samplers[sampler] = (Weights(f"snapshot:{sampler}", tensors, config), None)
            return {"sampling_session_id": sampler, "type": "save_weights_for_sampler"}

        return self._ordered(model_id, seq_id, "SaveWeightsForSampler", work)

    def _write(self, directory: Path, overwrite: bool, fill) -> None:
        if directory.exists() and not overwrite:
            raise Refused(f"a checkpoint named {directory.name!r} exists (pass overwrite)")
        write_dir(directory, fill, durable=True, replace=overwrite)

    def checkpoint(self, path: str) -> Checkpoint:
        client, kind, name = parse_path(path)
        directory = self.directory / "checkpoints" / client / kind / name
        if not (directory / "adapter_config.json").is_file():
            raise NotFound(f"no checkpoint {path}")
        return Checkpoint(path, directory, client, kind, name, directory.stat().st_mtime)

    def checkpoints(self, client: str | None = None) -> list[Checkpoint]:
        root = self.directory / "checkpoints"
        found = []
        for directory in sorted(root.glob("*/*/*")):
            if directory.name.startswith(".") or (
                client and directory.parent.parent.name != client
            ):
                continue
            if (directory / "adapter_config.json").is_file():
                c, kind, name = directory.parent.parent.name, directory.parent.name, directory.name
                found.append(self.checkpoint(checkpoint_path(c, kind, name)))
        return found

    def delete_checkpoint(self, path: str) -> None:
        import shutil

        found = self.checkpoint(path)
        shutil.rmtree(found.directory)
        self.sampler.forget(path)

    def load_state(
        self,
        path: str,
        optimizer: bool,
        model_id: str | None = None,
        seq_id: int = 0,
        session: str | None = None,
        seq: int | None = None,
    ) -> Record:
        """Into an existing client (`model_id`, in its order), or a new one `{session}:train:{seq}`
        made as the checkpoint's was."""
        if model_id is not None:
            trainer = self.client(model_id).trainer
            return self._ordered(
                model_id, seq_id, "LoadWeights", lambda: self._load(trainer, path, optimizer)
            )
        if session is None or seq is None:
            raise Refused("load_weights: give model_id, or session_id and model_seq_id")
        found = self._loadable(path, optimizer)
        source = self.client_spec(found)
        new_id = f"{session}:train:{seq}"
        record = self.futures.new("LoadWeights")

        def work() -> dict[str, Any]:
            client = self._add_client(new_id, session, source[0], source[1], {})
            return self._load(client.trainer, path, optimizer)

        return self.turns.run_now(record, work)

    def _loadable(self, path: str, optimizer: bool) -> Checkpoint:
        found = self.checkpoint(path)
        if optimizer and found.kind != "weights":
            raise Refused(f"{path}: a sampler's weights hold no optimizer state")
        return found

    def _load(self, trainer: TrainingClient, path: str, optimizer: bool) -> dict[str, Any]:
        found = self._loadable(path, optimizer)
        trainer.load(found.directory, optimizer)
        return {"path": found.path, "model_id": trainer.model_id, "type": "load_weights"}

    def client_spec(self, found: Checkpoint) -> tuple[str, LoraSpec]:
        """The base model and LoRA a checkpoint was made with (from its peft config)."""
        config = json.loads((found.directory / "adapter_config.json").read_text())
        targets = set(config.get("target_modules") or [])
        spec = LoraSpec(
            rank=int(config["r"]),
            train_attn="q_proj" in targets,
            train_mlp="up_proj" in targets,
            train_unembed="lm_head" in targets,
        )
        with self._lock:
            known = self.clients.get(found.client)
        return (known.base_model if known else str(self.model)), spec

    def training_runs(self) -> list[dict[str, Any]]:
        """Every training client, those of the checkpoints on disk included (RestClient's runs)."""
        with self._lock:
            known = set(self.clients)
        on_disk = {c.client for c in self.checkpoints()}
        return [self.training_run(run) for run in sorted(known | on_disk)]

    def training_run(self, run: str) -> dict[str, Any]:
        with self._lock:
            client = self.clients.get(run)
        saved = self.checkpoints(run)
        if client is None and not saved:
            raise NotFound(f"no training run {run!r}")
        weights = [c for c in saved if c.kind == "weights"]
        sampler = [c for c in saved if c.kind == "sampler_weights"]
        if client is not None:
            spec, base, metadata = client.trainer.spec, client.base_model, client.metadata
            seen = client.last_request
        else:
            base, spec = self.client_spec(saved[-1])
            metadata, seen = {}, max(c.time for c in saved)
        return {
            "training_run_id": run,
            "base_model": base,
            "model_owner": "orbit",
            "is_lora": True,
            "lora_rank": spec.rank,
            "corrupted": False,
            "last_request_time": datetime.fromtimestamp(seen, tz=timezone.utc).isoformat(),
            "last_checkpoint": None,
            "last_sampler_checkpoint": None,
            "user_metadata": {k: str(v) for k, v in metadata.items()},
            "checkpoints": len(weights) + len(sampler),
        }

    def weights_info(self, path: str) -> dict[str, Any]:
        base, spec = self.client_spec(self.checkpoint(path))
        return {
            "base_model": base,
            "is_lora": True,
            "lora_rank": spec.rank,
            "train_attn": spec.train_attn,
            "train_mlp": spec.train_mlp,
            "train_unembed": spec.train_unembed,
        }

    # -- sampling ---------------------------------------------------------------------------

    def create_sampler(
        self, session: str, seq: int, model_path: str | None, base_model: str | None
    ) -> str:
        if model_path:
            found = self.checkpoint(model_path)
            config = json.loads((found.directory / "adapter_config.json").read_text())
            tensors = load_file(found.directory / "adapter_model.safetensors")
            weights = Weights(model_path, tensors, config)
        else:
            self.check_base(base_model or "")
            weights = BASE
        sampler = f"{session}:sample:{seq}"
        with self._lock:
            self.samplers[sampler] = (weights, model_path)
        return sampler

    def sampler_info(self, sampler: str) -> dict[str, Any]:
        with self._lock:
            found = self.samplers.get(sampler)
        if found is None:
            raise NotFound(f"no sampling session {sampler!r}")
        base = str(self.model)
        if found[1]:
            base = self.client_spec(self.checkpoint(found[1]))[0]
        return {"sampler_id": sampler, "base_model": base, "model_path": found[1]}

    def sample(
        self,
        sampler: str,
        prompt: list[int],
        params: SamplingParams,
        n: int,
        stops: Stops,
    ) -> Record:
        with self._lock:
            found = self.samplers.get(sampler)
        if found is None:
            raise NotFound(f"no sampling session {sampler!r}")
        self._check_prompt(prompt, params.max_new_tokens)
        if n < 1:
            raise Refused(f"num_samples: {n}; at least 1")
        record = self.futures.new("Sample", proto=True)
        submitted = self._sampling.submit(self.sampler.sample, found[0], prompt, params, n, stops)
        submitted.add_done_callback(lambda f: _chain(f, record.future))
        return record

    def _check_prompt(self, prompt: list[int], max_tokens: int) -> None:
        if not prompt:
            raise Refused("prompt: no tokens")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise Refused(
                f"prompt: token id {bad[0]} outside the vocabulary (0..{self.vocab_size - 1})"
            )
        if len(prompt) + max_tokens > self.max_context:
            raise Refused(
                f"sampling_params.max_tokens: {max_tokens} after a prompt of {len(prompt)} tokens "
                f"passes the engines' context of {self.max_context} tokens"
            )


def _chain(sampled: Future, result: Future) -> None:
    """The sampling call's outcome onto the request's future, the sequences as the wire's bytes."""
    try:
        inner: Future = sampled.result()
    except Refused as err:
        result.set_exception(RequestFailed(str(err), "user"))
        return
    except BaseException as err:  # noqa: BLE001 - the request's failure, said to its client
        result.set_exception(RequestFailed(f"{type(err).__name__}: {err}", "server"))
        return

    def done(f: Future) -> None:
        try:
            result.set_result(wire.sample_response(f.result(), None))
        except BaseException as err:  # noqa: BLE001 - as above
            result.set_exception(RequestFailed(f"{type(err).__name__}: {err}", "server"))

    inner.add_done_callback(done)
