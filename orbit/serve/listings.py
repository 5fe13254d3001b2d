"""What the RestClient reads: a tenant's sessions, training runs and checkpoints' info, and its
exports' download links. Nothing here runs on the trainer or an engine: each answer is read from the
store (store.py) and the checkpoints on disk (checkpoints.py), and a download's link is checked
against the service's secret (exports.py), so it is answered in place."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orbit.serve import exports, search
from orbit.serve.bodies import SearchSessions
from orbit.serve.checkpoints import Checkpoint, Checkpoints, files, iso, rest_checkpoint
from orbit.serve.futures import NotFound, Refused
from orbit.serve.store import ClientRow, Store


@dataclass
class Listings:
    """The tenant's records, as the RestClient's routes list them."""

    store: Store
    checkpoints: Checkpoints
    links: exports.Links

    def session_ids(self, tenant: str) -> list[str]:
        """The tenant's sessions, newest first (RestClient.list_sessions)."""
        return [row.id for row in self.store.sessions(tenant)]

    def session_info(self, tenant: str, session: str) -> dict[str, Any]:
        """What a session made (RestClient.get_session), ended or not."""
        row = self.store.session(session)
        if row is None or row.tenant != tenant:
            raise NotFound(f"no session {session!r}")
        clients = [c.id for c in self.store.clients(tenant) if c.session == session]
        samplers = [x.id for x in self.store.samplers() if x.id.split(":")[0] == session]
        return {
            "training_run_ids": clients,
            "sampler_ids": [x for x in samplers if self.store.sampler(x) is not None],
            "user_metadata": search.metadata(row),
            "display_name": row.display_name,
        }

    def search_sessions(self, tenant: str, query: SearchSessions) -> dict[str, Any]:
        """RestClient.search_sessions: a page of the tenant's sessions (search.py)."""
        saved: dict[str, list[Checkpoint]] = {}
        for c in self.checkpoints.of(tenant):
            saved.setdefault(c.client.split(":")[0], []).append(c)
        rows = self.store.sessions(tenant)
        return search.search(tenant, rows, query, lambda s: saved.get(s, []))

    def storage_usage(self, tenant: str, project: str | None) -> dict[str, Any]:
        """get_current_checkpoint_storage_usage: the tenant's checkpoints' bytes (search.py)."""
        return search.usage(tenant, project, self.checkpoints.of(tenant))

    def external_urls(self, tenant: str, path: str, base_url: str) -> dict[str, Any]:
        """RestClient.get_external_weights_urls: a signed link to each file of an export."""
        found = self.checkpoints.get(tenant, path)
        if found.kind != "external_weights":
            raise Refused(f"{path}: only external weights are downloaded (save_weights_external)")
        links = [exports.Link(tenant, path, f) for f in files(found)]
        urls, expires = self.links.urls(base_url, links)
        return {"urls": urls, "expires": iso(expires)}

    def external_file(self, token: str) -> Path:
        """The file a download link names, while its export lasts."""
        link = self.links.open(token)
        found = self.checkpoints.get(link.tenant, link.path)
        if link.file not in files(found):
            raise NotFound(f"{link.path} has no file {link.file!r}")
        return found.directory / link.file

    def training_runs(self, tenant: str) -> list[dict[str, Any]]:
        """The tenant's training clients, lost ones included (RestClient's runs)."""
        return [self._run(row) for row in self.store.clients(tenant)]

    def training_run(self, tenant: str, run: str) -> dict[str, Any]:
        row = self.store.client(run)
        if row is None or row.tenant != tenant:
            raise NotFound(f"no training run {run!r}")
        return self._run(row)

    def _run(self, row: ClientRow) -> dict[str, Any]:
        saved = self.checkpoints.of(row.tenant, row.id)

        def newest(kind: str) -> dict[str, Any] | None:
            found = [c for c in saved if c.kind == kind]
            return rest_checkpoint(found[-1]) if found else None

        return {
            "training_run_id": row.id,
            "base_model": row.base_model,
            "model_owner": row.tenant,
            "is_lora": True,
            "lora_rank": row.rank,
            "corrupted": False,
            "last_request_time": iso(row.last_request),
            "last_checkpoint": newest("weights"),
            "last_sampler_checkpoint": newest("sampler_weights"),
            "user_metadata": {k: str(v) for k, v in row.user_metadata.items()},
        }

    def run_checkpoints(self, tenant: str, run: str) -> dict[str, Any]:
        """A training run's checkpoints (not found for a run that is not the tenant's)."""
        self.training_run(tenant, run)
        found = [rest_checkpoint(c) for c in self.checkpoints.of(tenant, run)]
        return {"checkpoints": found, "cursor": None}

    def checkpoints_page(self, tenant: str, limit: int, offset: int) -> dict[str, Any]:
        """The tenant's checkpoints, `limit` from `offset`."""
        found = [rest_checkpoint(c) for c in self.checkpoints.of(tenant)]
        return {
            "checkpoints": found[offset : offset + limit],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(found)},
        }

    def weights_info(self, tenant: str, path: str) -> dict[str, Any]:
        return self.checkpoints.info(self.checkpoints.get(tenant, path, reading=True))
