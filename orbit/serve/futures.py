"""Futures: every mutating call answers at once with a request id, and the client polls
`retrieve_future` until the work is done. A poll waits (up to `POLL_S`) for the result, so a client
is answered as soon as it is ready without polling in a loop; a failure answers with its message and
category ("user": the request's own fault, "server": Orbit's), never a hang.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

POLL_S = 25.0  # a poll waits this long for the result (the SDK gives a poll 45 s)
KEEP_S = 600.0  # a finished result stays retrievable this long (a poll whose answer was lost)


class Refused(ValueError):
    """A request Orbit will not do, its sender's to fix: it fails with category "user" and changes
    nothing."""


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
    done_at: float = 0.0


class Futures:
    def __init__(self) -> None:
        self._records: dict[str, Record] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    def new(self, kind: str, proto: bool = False, owner: str = "") -> Record:
        with self._lock:
            self._purge()
            record = Record(f"req-{next(self._ids)}", kind, proto, owner)
            self._records[record.id] = record
        record.future.add_done_callback(lambda _: setattr(record, "done_at", time.monotonic()))
        return record

    def get(self, request_id: str) -> Record | None:
        with self._lock:
            return self._records.get(request_id)

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
