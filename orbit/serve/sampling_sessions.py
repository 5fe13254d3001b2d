"""Sampling sessions: `{session}:sample:{k}`, each bound to the weights it samples (the base model,
a checkpoint, an unnamed snapshot of a training client, or a training client's inflight target),
recorded in the store for its tenant. The weights are read once and kept in memory; after a restart
a session reads them again from disk (a snapshot is written under DIR/snapshots/ for that). A
training client's newest `SNAPSHOTS_KEPT` snapshots are kept: an RL loop makes one a step.

Inflight (Tinker's `kind="inflight"`): each of a training client's inflight saves publishes a new
version of one mutable target and opens a session on it; every session of the target samples its
newest version from its next request on (samplers.py flips the engines), never one older than the
version it was created at. The target's newest version is also on disk, for a restart.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from orbit.host.files import recover_dir, write_dir
from orbit.serve.bases import Bases
from orbit.serve.checkpoints import Checkpoints
from orbit.serve.clients import TrainingClient
from orbit.serve.futures import NotFound
from orbit.serve.samplers import BASE, Weights
from orbit.serve.store import SamplerRow, Store

SNAPSHOTS_KEPT = 4  # a training client's newest unnamed snapshots kept, in memory and on disk


def sampler_id(session: str, seq: int) -> str:
    """A sampling session's id: the SDK session it belongs to, then its number in that session."""
    return f"{session}:sample:{seq}"


def session_of(sampler: str) -> str:
    """The SDK session a sampling session belongs to (`sampler_id`'s first part)."""
    return sampler.rsplit(":sample:", 1)[0]


def read_weights(key: str, directory: Path) -> Weights:
    if not (directory / "adapter_config.json").is_file():
        raise NotFound(f"the weights of {key} are no longer on disk")
    config = json.loads((directory / "adapter_config.json").read_text())
    return Weights(key, load_file(directory / "adapter_model.safetensors"), config)


class Target:
    """A training client's inflight weights: `publish` makes a new version, `newest` is it."""

    def __init__(self, model_id: str, directory: Path, weights: Weights | None = None) -> None:
        self.model_id, self.directory = model_id, directory
        self.key = f"inflight:{model_id}"
        self._weights = weights
        self._lock = threading.Lock()

    def publish(self, tensors: dict, config: dict) -> Weights:
        with self._lock:
            version = self._weights.version + 1 if self._weights else 1
            self._weights = Weights(self.key, tensors, config, version)
            return self._weights

    def newest(self) -> Weights:
        with self._lock:
            assert self._weights is not None
            return self._weights


class SamplingSessions:
    """Every tenant's sampling sessions: `snapshots` is where unnamed snapshots go, `bases` the
    served base models (a session samples on its row's `base_model`'s engines)."""

    def __init__(
        self, snapshots: Path, store: Store, checkpoints: Checkpoints, bases: Bases
    ) -> None:
        self.snapshots, self.store, self.checkpoints = snapshots, store, checkpoints
        self.bases = bases
        self._weights: dict[str, Weights] = {}
        self._kept: dict[str, deque[str]] = {}  # training client -> its snapshots, oldest first
        self._targets: dict[str, Target] = {}  # training client -> its inflight target
        self._floors: dict[str, int] = {}  # inflight session -> the version it was created at
        self._lock = threading.Lock()
        recover_dir(snapshots)

    def open(
        self, tenant: str, sampler: str, base_model: str, model_path: str | None = None
    ) -> None:
        """A session on the base model, or on the checkpoint at `model_path` (the tenant's, or one
        published)."""
        weights = BASE
        if model_path:
            found = self.checkpoints.loadable(tenant, model_path)
            weights = read_weights(model_path, found.directory)
        self._bind(self._row(tenant, sampler, base_model, model_path, None), weights)

    def snapshot(self, tenant: str, sampler: str, trainer: TrainingClient, base: str) -> None:
        """A session on `trainer`'s adapter as it is now (written to disk first); `base`: the name
        its client gave its base model."""
        directory = self.snapshots / sampler
        write_dir(directory, lambda d: trainer.save(d, optimizer=False), True, replace=True)
        tensors, config = trainer.adapter()
        weights = Weights(f"snapshot:{sampler}:{uuid.uuid4().hex[:8]}", tensors, config)
        self._bind(self._row(tenant, sampler, base, None, str(directory)), weights)
        with self._lock:
            kept = self._kept.setdefault(trainer.model_id, deque())
            kept.append(sampler)
            old = [kept.popleft() for _ in range(max(0, len(kept) - SNAPSHOTS_KEPT))]
        for gone in old:
            self._unbind(gone)
            shutil.rmtree(self.snapshots / gone, ignore_errors=True)

    def publish(
        self, tenant: str, sampler: str, trainer: TrainingClient, base: str, executor: Executor
    ) -> int:
        """An inflight save: `trainer`'s adapter as it is now becomes its target's newest version
        (on disk first), and `sampler` a session on the target. The engines of `base` (its client's
        name for its base model) flip in the background (on `executor`): this returns the version
        once the target is updated."""
        with self._lock:
            target = self._targets.get(trainer.model_id)
            if target is None:
                directory = self.snapshots / f"inflight-{trainer.model_id}"
                target = self._targets[trainer.model_id] = Target(trainer.model_id, directory)
        save = lambda d: trainer.save(d, optimizer=False)  # noqa: E731 - the adapter alone
        write_dir(target.directory, save, True, replace=True)
        weights = target.publish(*trainer.adapter())
        row = self._row(tenant, sampler, base, None, str(target.directory))
        row.target = trainer.model_id
        self.store.add_sampler(row)
        with self._lock:
            self._weights.pop(sampler, None)
            self._floors[sampler] = weights.version
        self.bases.named(base).sampler.publish(weights, executor)
        return weights.version

    def targets(self) -> list[Target]:
        """The inflight targets, by training client."""
        with self._lock:
            return sorted(self._targets.values(), key=lambda t: t.model_id)

    def release(self, rows: list[SamplerRow]) -> None:
        """Sessions that ended: unbound, their snapshots and inflight targets deleted (named
        checkpoints stay)."""
        for row in rows:
            self._unbind(row.id)
            if row.snapshot and not row.target:
                shutil.rmtree(row.snapshot, ignore_errors=True)
        ended = {row.id.split(":")[0] for row in rows}
        with self._lock:
            for trainer in [t for t in self._kept if t.split(":")[0] in ended]:
                del self._kept[trainer]
            gone = [self._targets.pop(t) for t in list(self._targets) if t.split(":")[0] in ended]
        for target in gone:
            self.bases.forget(target.key)
            shutil.rmtree(target.directory, ignore_errors=True)

    def _row(
        self, tenant: str, sampler: str, base: str, model_path: str | None, snapshot: str | None
    ) -> SamplerRow:
        return SamplerRow(
            id=sampler,
            instance=self.store.instance,
            tenant=tenant,
            base_model=base,
            model_path=model_path or None,
            snapshot=snapshot,
            created=time.time(),
        )

    def _bind(self, row: SamplerRow, weights: Weights) -> None:
        self.store.add_sampler(row)
        with self._lock:
            self._weights[row.id] = weights

    def _unbind(self, sampler: str) -> None:
        with self._lock:
            weights = self._weights.pop(sampler, None)
            self._floors.pop(sampler, None)
        self.store.drop_sampler(sampler)
        if weights is not None and not weights.key.startswith("inflight:"):
            self.bases.forget(weights.key)

    def _row_of(self, tenant: str, sampler: str) -> SamplerRow:
        row = self.store.sampler(sampler)
        if row is None or row.tenant != tenant:
            raise NotFound(f"no sampling session {sampler!r}")
        return row

    def weights(self, tenant: str, sampler: str) -> Weights:
        """The tenant's session's weights (read from disk once after a restart)."""
        row = self._row_of(tenant, sampler)
        with self._lock:
            weights = self._weights.get(sampler)
            floor = self._floors.get(sampler)
            target = self._targets.get(row.target) if row.target else None
        if target is not None and floor is not None:
            return dataclasses.replace(target.newest(), floor=floor)
        if weights is None:
            if row.target and row.snapshot:  # after a restart: the target's newest, fixed
                weights = read_weights(f"inflight:{row.target}", Path(row.snapshot))
            elif row.snapshot:
                weights = read_weights(f"snapshot:{sampler}:{row.created}", Path(row.snapshot))
            elif row.model_path:
                found = self.checkpoints.loadable(tenant, row.model_path)
                weights = read_weights(row.model_path, found.directory)
            else:
                weights = BASE
            with self._lock:
                self._weights[sampler] = weights
        return weights

    def info(self, tenant: str, sampler: str) -> dict[str, Any]:
        row = self._row_of(tenant, sampler)
        return {"sampler_id": sampler, "base_model": row.base_model, "model_path": row.model_path}
