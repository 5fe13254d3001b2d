"""Checkpoints: `tinker://{client}/{weights|sampler_weights|external_weights}/{name}`, a peft
adapter (and with `save_state` the optimizer; an export's files perhaps encrypted: exports.py) in
DIR/checkpoints/ under the same three parts, and a row in the store for its tenant. A directory is
written whole before its row (orbit/host/files.py): a kill leaves the previous checkpoint, and
`reconcile` makes the disk and the store agree at start.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from orbit.host.files import recover_dir, write_dir
from orbit.serve.clients import LoraSpec
from orbit.serve.futures import NotFound, Refused
from orbit.serve.store import CheckpointRow, Store

# a training checkpoint (adapter + optimizer), a sampler's, an export for download (exports.py)
KINDS = ("weights", "sampler_weights", "external_weights")
TYPES = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}


MAX_TTL_S = 10 * 365 * 86400  # the SDK's bound: ten years (None: never expires)


@dataclass
class Checkpoint:
    path: str  # tinker://...
    directory: Path
    client: str
    kind: str
    name: str
    time: float
    expires: float | None = None  # its TTL's end (time.time); None: never
    user_metadata: dict[str, str] | None = None
    public: bool = False  # published: other tenants may sample and load it
    size_bytes: int = 0  # on disk, as saved


def checkpoint_path(client: str, kind: str, name: str) -> str:
    return f"tinker://{client}/{kind}/{name}"


def parse_path(path: str) -> tuple[str, str, str]:
    """(client, kind, name) of a tinker:// path; NotFound when it is not one Orbit writes."""
    parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in KINDS or not all(parts):
        raise NotFound(
            f"{path!r} is not a checkpoint path (tinker://<training run>/"
            "<weights|sampler_weights|external_weights>/<name>)"
        )
    return parts[0], parts[1], parts[2]


def rest_checkpoint(c: Checkpoint) -> dict[str, Any]:
    """A checkpoint as RestClient reads it."""
    return {
        "checkpoint_id": f"{c.kind}/{c.name}",
        "checkpoint_type": TYPES[c.kind],
        "time": iso(c.time),
        "tinker_path": c.path,
        "size_bytes": c.size_bytes,
        "public": c.public,
        "expires_at": iso(c.expires) if c.expires is not None else None,
        "user_metadata": c.user_metadata,
    }


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat()


def files(found: Checkpoint) -> list[str]:
    """A checkpoint's files; NotFound when its directory went meanwhile (a delete, an overwrite)."""
    try:
        return sorted(f.name for f in found.directory.iterdir() if f.is_file())
    except FileNotFoundError:
        raise NotFound(f"no checkpoint {found.path}") from None


def _whole(directory: Path) -> bool:
    """Whether a checkpoint's directory holds its adapter (an export's perhaps encrypted)."""
    return any((directory / f"adapter_config.json{x}").is_file() for x in ("", ".age"))


def _size(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.iterdir() if f.is_file())


def _of(row: CheckpointRow) -> Checkpoint:
    return Checkpoint(
        row.path,
        Path(row.directory),
        row.client,
        row.kind,
        row.name,
        row.created,
        row.expires,
        row.user_metadata,
        bool(row.public),
        row.size_bytes,
    )


def expiry(ttl_seconds: int | None, now: float) -> float | None:
    """When a checkpoint saved `now` with `ttl_seconds` expires; Refused for a TTL out of range."""
    if ttl_seconds is None:
        return None
    if not 1 <= ttl_seconds <= MAX_TTL_S:
        raise Refused(f"ttl_seconds: {ttl_seconds}; from 1 to {MAX_TTL_S} (ten years), or none")
    return now + ttl_seconds


class Checkpoints:
    """Every tenant's checkpoints under `root` (DIR/checkpoints), recorded in `store`; `base` is the
    base model's name for a checkpoint whose client is not known and whose peft config names
    none."""

    def __init__(self, root: Path, store: Store, base: str) -> None:
        self.root, self.store, self.base = root, store, base

    def made_with(self, found: Checkpoint) -> tuple[str, LoraSpec]:
        """The base model and LoRA a checkpoint was made with: its client's, as created (else read
        from its peft config)."""
        row = self.store.client(found.client)
        if row is not None:
            spec = LoraSpec(row.rank, row.seed, row.train_attn, row.train_mlp, row.train_unembed)
            return row.base_model, spec
        config = json.loads((found.directory / "adapter_config.json").read_text())
        targets = set(config.get("target_modules") or [])
        spec = LoraSpec(
            rank=int(config["r"]),
            train_attn="q_proj" in targets,
            train_mlp="up_proj" in targets,
            train_unembed="lm_head" in targets,
        )
        # peft records the base's path (an absolute path: one of the base's names)
        return str(config.get("base_model_name_or_path") or self.base), spec

    def info(self, found: Checkpoint) -> dict[str, Any]:
        """RestClient's weights info of a checkpoint."""
        base, spec = self.made_with(found)
        return {
            "base_model": base,
            "is_lora": True,
            "lora_rank": spec.rank,
            "train_attn": spec.train_attn,
            "train_mlp": spec.train_mlp,
            "train_unembed": spec.train_unembed,
        }

    def directory(self, client: str, kind: str, name: str) -> Path:
        """Where a checkpoint goes; Refused for a name that could leave its directory."""
        if not name or "/" in name or name.startswith(".") or len(name) > 200:
            raise Refused(
                f"checkpoint name {name[:60]!r}: a name of at most 200 characters, without '/', "
                "that does not start with '.'"
            )
        return self.root / client / kind / name

    def save(
        self,
        tenant: str,
        client: str,
        kind: str,
        name: str,
        fill: Callable[[Path], object],
        overwrite: bool,
        ttl_seconds: int | None = None,
        user_metadata: dict[str, str] | None = None,
    ) -> str:
        """Write a checkpoint whole (a kill leaves the previous one), then record it, with the time
        its TTL ends and the client's metadata: its path."""
        directory = self.directory(client, kind, name)
        if directory.exists() and not overwrite:
            raise Refused(f"a checkpoint named {name!r} exists (pass overwrite)")
        now = time.time()
        expires = expiry(ttl_seconds, now)
        write_dir(directory, fill, durable=True, replace=overwrite)
        path = checkpoint_path(client, kind, name)
        self._record(path, tenant, client, kind, name, directory, now, expires, user_metadata)
        return path

    def copy(self, tenant: str, found: Checkpoint, run: str, ttl_seconds: int | None) -> str:
        """`found` (the tenant's, or published) copied whole under the tenant's training run `run`,
        with its kind, name and metadata and a TTL of its own: the copy's path."""

        def fill(directory: Path) -> None:
            for f in files(found):
                shutil.copy2(found.directory / f, directory / f)

        return self.save(
            tenant, run, found.kind, found.name, fill, False, ttl_seconds, found.user_metadata
        )

    def _record(
        self,
        path: str,
        tenant: str,
        client: str,
        kind: str,
        name: str,
        directory: Path,
        created: float,
        expires: float | None = None,
        user_metadata: dict[str, str] | None = None,
    ) -> None:
        self.store.add_checkpoint(
            CheckpointRow(
                path=path,
                instance=self.store.instance,
                tenant=tenant,
                client=client,
                kind=kind,
                name=name,
                directory=str(directory),
                created=created,
                size_bytes=_size(directory),
                expires=expires,
                user_metadata=user_metadata,
                public=False,  # a save over a published one is new content: published again or not
            )
        )

    def get(self, tenant: str, path: str, reading: bool = False) -> Checkpoint:
        """The tenant's checkpoint at `path`, or with `reading` (to sample or load it) one another
        tenant published; NotFound for any other, and naming its expiry for one whose TTL ended."""
        parse_path(path)
        row = self.store.checkpoint(path)
        if row is None or (row.tenant != tenant and not (reading and row.public)):
            raise NotFound(f"no checkpoint {path}")
        if row.expires is not None and row.expires <= time.time():
            raise NotFound(f"checkpoint {path} expired at {iso(row.expires)} (its ttl_seconds)")
        return _of(row)

    def loadable(self, tenant: str, path: str) -> Checkpoint:
        """A checkpoint to sample or load (`get` with `reading`): not an export, which is for
        download."""
        found = self.get(tenant, path, reading=True)
        if found.kind == "external_weights":
            raise Refused(
                f"{path} is external weights, for download (RestClient.get_external_weights_urls); "
                "sample or load a weights or sampler_weights checkpoint"
            )
        return found

    def of(self, tenant: str, client: str | None = None) -> list[Checkpoint]:
        """The tenant's checkpoints (of one client) that have not expired, oldest first."""
        now = time.time()
        rows = self.store.checkpoints(tenant, client)
        return [_of(r) for r in rows if r.expires is None or r.expires > now]

    def publish(self, tenant: str, path: str, public: bool) -> None:
        """Publish the tenant's checkpoint (every tenant may then sample and load it, by its path),
        or take that back; only its own tenant lists, deletes or sets its TTL."""
        self.get(tenant, path)
        self.store.set_public(path, public)

    def set_ttl(self, tenant: str, path: str, ttl_seconds: int | None) -> None:
        """A new TTL for the tenant's checkpoint, counted from now (None: it never expires)."""
        self.get(tenant, path)
        self.store.set_expiry(path, expiry(ttl_seconds, time.time()))

    def expire(self) -> list[str]:
        """Delete the files of this process's checkpoints whose TTL ended; their rows stay, so that
        a later request for one is told it expired. Their paths."""
        gone = []
        for row in self.store.expired_checkpoints(time.time()):
            if Path(row.directory).exists():
                shutil.rmtree(row.directory, ignore_errors=True)
                gone.append(row.path)
        return gone

    def delete(self, tenant: str, path: str) -> None:
        found = self.get(tenant, path)
        self.store.drop_checkpoint(path)
        shutil.rmtree(found.directory, ignore_errors=True)

    def reconcile(self) -> None:
        """The disk and the store agree after a kill: half-written directories go (and one set aside
        for an overwrite comes back), rows whose directory is gone go, and a checkpoint written just
        before a kill, whose row was not yet written, is recorded for its client's tenant."""
        for kind_dir in self.root.glob("*/*"):
            recover_dir(kind_dir)
        known = set()
        for row in self.store.checkpoints(mine=True):
            if _whole(Path(row.directory)):
                known.add(row.path)
            elif row.expires is not None and row.expires <= time.time():
                known.add(row.path)  # expired: its row says so
            else:
                self.store.drop_checkpoint(row.path)
        for directory in self.root.glob("*/*/*"):
            client, kind, name = directory.parent.parent.name, directory.parent.name, directory.name
            path = checkpoint_path(client, kind, name)
            owner = self.store.client(client)
            if path in known or owner is None or kind not in KINDS or name.startswith("."):
                continue
            if _whole(directory):
                created = directory.stat().st_mtime
                self._record(path, owner.tenant, client, kind, name, directory, created)
