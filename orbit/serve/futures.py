"""Futures: every mutating call answers at once with a request id, and the client polls
`retrieve_future` until the work is done. A poll waits (up to `POLL_S`) for the result, so a client
is answered as soon as it is ready without polling in a loop; a failure answers with its message and
category ("user": the request's own fault, "server": Orbit's), never a hang.

Each future is a row in the store too (store.py): written when it is issued and when it ends, so
that a poll after a restart gets the result it missed, or the failure of the work the restart
ended, never "try again" forever.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from orbit.serve.store import Outcome, Store

POLL_S = 25.0  # a poll waits this long for the result (the SDK gives a poll 45 s)
KEEP_S = 3600.0  # a finished result stays retrievable this long (a poll whose answer was lost)
LATENCIES_KEPT = 1000  # a kind of request's newest latencies, for the page


class Refused(ValueError):
    """A request Orbit will not do, its sender's to fix: it fails with category "user" and changes
    nothing."""


class NotFound(Refused):
    """A session, client, sampler, request or checkpoint that does not exist or is another
    tenant's (HTTP 404)."""


class Gone(NotFound):
    """A session that ended, or what it held (HTTP 410: the SDK's heartbeat stops on it)."""


class Busy(Refused):
    """A request past its tenant's limits (HTTP 429): nothing changed, it may come again later."""


class RequestFailed(Exception):
    """The work failed: `message` and `category` go to the client."""

    def __init__(self, message: str, category: str = "server") -> None:
        super().__init__(message)
        self.category = category


@dataclass
class Record:
    """One request's future. `proto`: its result is a protocol buffer (forward_backward,
    asample)."""

    id: str
    kind: str
    proto: bool
    owner: str
    future: Future = field(default_factory=Future)
    created: float = field(default_factory=time.monotonic)
    done_at: float = 0.0


class Futures:
    def __init__(self, store: Store) -> None:
        self.store = store
        self._records: dict[str, Record] = {}
        self._lock = threading.Lock()
        self.latency: dict[str, deque[float]] = {}  # per kind: the newest requests' seconds

    def new(self, kind: str, owner: str, proto: bool = False) -> Record:
        with self._lock:
            self._purge()
            # unguessable, and unique among processes that share a database
            record = Record(f"req-{uuid.uuid4().hex[:20]}", kind, proto, owner)
            self._records[record.id] = record
        self.store.add_future(record.id, owner, kind, proto)
        record.future.add_done_callback(lambda _: self._finished(record))
        return record

    def _finished(self, record: Record) -> None:
        record.done_at = time.monotonic()
        with self._lock:
            kept = self.latency.setdefault(record.kind, deque(maxlen=LATENCIES_KEPT))
            kept.append(record.done_at - record.created)
        err = record.future.exception()
        if err is None:
            self.store.finish_future(record.id, record.future.result())
        else:
            category = err.category if isinstance(err, RequestFailed) else "server"
            self.store.finish_future(record.id, error=str(err), category=category)

    def get(self, request_id: str, owner: str) -> Record | Outcome | None:
        """The owner's request: its live record, or its stored outcome (one that ended before a
        restart, or whose record was purged); None when it is not the owner's."""
        with self._lock:
            record = self._records.get(request_id)
        if record is not None:
            return record if record.owner == owner else None
        stored = self.store.future(request_id)
        if stored is None or stored[0] != owner or stored[1] is None:
            return None
        return stored[1]

    def pending(self, owner: str) -> int:
        """The owner's requests not yet done."""
        with self._lock:
            return sum(1 for r in self._records.values() if r.owner == owner and not r.done_at)

    def waiting(self) -> dict[str, int]:
        """Requests not yet done, per owner."""
        with self._lock:
            found: dict[str, int] = {}
            for r in self._records.values():
                if not r.done_at:
                    found[r.owner] = found.get(r.owner, 0) + 1
            return found

    def latencies(self) -> dict[str, list[float]]:
        """Per kind of request: the newest ones' seconds from issue to done."""
        with self._lock:
            return {kind: list(kept) for kind, kept in self.latency.items()}

    async def wait(self, record: Record, seconds: float = POLL_S) -> bool:
        """Whether the record is done, waiting up to `seconds` for it."""
        if not record.future.done():
            await asyncio.wait([asyncio.wrap_future(record.future)], timeout=seconds)
        return record.future.done()

    def _purge(self) -> None:
        now = time.monotonic()
        gone = [k for k, r in self._records.items() if r.done_at and now - r.done_at > KEEP_S]
        for k in gone:
            del self._records[k]
        if gone:
            self.store.purge_futures(time.time() - KEEP_S)


def result_of(record: Record | Outcome) -> tuple[Any, bool] | RequestFailed:
    """A finished request's result (and whether it is protocol buffer bytes), or its failure."""
    if isinstance(record, Outcome):
        if record.error is not None:
            return RequestFailed(record.error, record.category or "server")
        return record.result or b"", record.proto
    err = record.future.exception()
    if err is not None:
        return err if isinstance(err, RequestFailed) else RequestFailed(str(err), "server")
    return record.future.result(), record.proto
