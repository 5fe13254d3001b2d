"""RestClient.search_sessions and get_current_checkpoint_storage_usage, within a tenant.

Orbit has no projects: a key is a tenant, and the tenant is its one project (the project's id is the
tenant's name). So a query naming another project is refused, as the SDK says ("naming a project
the caller cannot list is an error"), and so is a search of other owners' sessions by URN; the
sessions `accessible` to a key are its own. A session's status: `active` until it ends;
`client_finished` with the reason its client's close gave; none when it ended otherwise (its
heartbeat stopped). Orbit fails and cancels no session, so those statuses match none.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from orbit.serve.bodies import SearchSessions, StatusQuery
from orbit.serve.checkpoints import Checkpoint
from orbit.serve.futures import Refused
from orbit.serve.store import SessionRow

FINISHES = ("success", "errored", "interrupted")  # ServiceClient.close's statuses
GIGABYTE = 1e9  # the storage usage's unit


def check_projects(tenant: str, projects: list[str] | None) -> None:
    """Refused: a project other than the tenant's own."""
    other = next((p for p in projects or [] if p != tenant), None)
    if other is not None:
        raise Refused(
            f"project {other[:80]!r}: not this key's; Orbit has no projects, a key is a tenant and "
            f"its one project, {tenant!r}"
        )


def status(row: SessionRow) -> dict[str, Any] | None:
    """A session's status as the SDK's SessionStatus reads it."""
    if row.ended is None:
        return {"type": "active"}
    if row.finish in FINISHES:
        return {
            "type": "client_finished",
            "reason": {"type": row.finish},
            "detail": row.finish_detail,
        }
    return None


def search(
    tenant: str,
    rows: list[SessionRow],
    query: SearchSessions,
    checkpoints: Callable[[str], list[Checkpoint]],
) -> dict[str, Any]:
    """One page of the tenant's sessions `rows` that match `query`, newest first, each with its
    checkpoints' count and bytes (`checkpoints`: a session's)."""
    check_projects(tenant, query.project_ids)
    if query.owner.type == "user":
        raise Refused("owner: user; a key searches its own sessions (own, or accessible)")
    found = sorted(
        (r for r in rows if _matches(r, query)), key=lambda r: (_when(r), r.id), reverse=True
    )
    if query.cursor is not None:
        last = (query.cursor.last_created_at, query.cursor.last_session_id)
        found = [r for r in found if (_when(r), r.id) < last]
    page, more = found[: query.limit], found[query.limit :]
    cursor = None
    if more:
        cursor = {"last_created_at": _when(page[-1]).isoformat(), "last_session_id": page[-1].id}
    return {
        "sessions": [_summary(tenant, r, checkpoints(r.id)) for r in page],
        "next_cursor": cursor,
    }


def usage(tenant: str, project: str | None, saved: list[Checkpoint]) -> dict[str, Any]:
    """The tenant's checkpoints' storage (get_current_checkpoint_storage_usage): Orbit bills
    nobody, so no rate and no cost."""
    check_projects(tenant, [project] if project is not None else None)
    total = sum(c.size_bytes for c in saved)
    item = {
        "project_id": tenant,
        "checkpoint_count": len(saved),
        "size_bytes": total,
        "size_gigabytes": total / GIGABYTE,
    }
    return {"effective_rate_usd_per_gigabyte_month": None, "data": [item] if saved else []}


def metadata(row: SessionRow) -> dict[str, str]:
    """A session's user_metadata as the SDK reads it: strings."""
    return {k: str(v) for k, v in (row.user_metadata or {}).items()}


def _when(row: SessionRow) -> datetime:
    return datetime.fromtimestamp(row.created, tz=timezone.utc)


def _matches(row: SessionRow, query: SearchSessions) -> bool:
    named = query.session_id is not None or query.display_name is not None
    if named and not (row.id == query.session_id or _named(row, query.display_name)):
        return False
    meta = metadata(row)
    if any(meta.get(k) != v for k, v in query.user_metadata.items()):
        return False
    return query.statuses is None or any(_is(row, s) for s in query.statuses)


def _named(row: SessionRow, words: str | None) -> bool:
    """Each word of `words` somewhere in the display name, whatever the case."""
    name = (row.display_name or "").lower()
    return words is not None and all(w in name for w in words.lower().split())


def _is(row: SessionRow, wanted: StatusQuery) -> bool:
    have = status(row)
    if have is None or have["type"] != wanted.type:
        return False
    return wanted.reasons is None or row.finish in wanted.reasons


def _summary(tenant: str, row: SessionRow, saved: list[Checkpoint]) -> dict[str, Any]:
    return {
        "session_id": row.id,
        "created_at": _when(row).isoformat(),
        "owner": tenant,
        "project_id": tenant,
        "status": status(row),
        "checkpoints_count": len(saved),
        "display_name": row.display_name,
        "user_metadata": metadata(row),
        "checkpoint_storage_bytes": sum(c.size_bytes for c in saved),
    }
