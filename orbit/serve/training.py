"""The trainer's turns: every training client's requests, each client's in `seq_id` order, run on
one thread (the base computes for one adapter at a time). A client's next request runs as soon as it
is there; among clients with one ready, turns go round, so no client waits behind another's whole
queue.

The SDK numbers a client's requests from 1 and may send them out of order (a large forward_backward
goes as chunks in parallel, the first last): a request waits for those before it. One that never
comes (`GAP_S` after a later one arrived) fails the requests waiting behind it, with the reason,
rather than leaving them waiting.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from orbit.host.threads import compute_threads
from orbit.serve.futures import Record, Refused, RequestFailed

# The SDK sends a client's requests one after another, but for the chunks of one forward_backward
# (at once): a number missing this long after a later one arrived is one the client gave up on
# before sending (its own check refused the call).
GAP_S = 60.0


Work = Callable[[], Any]  # the request's work; its return value is the future's result


@dataclass
class Queue:
    """One client's requests: seq_id -> (future, work)."""

    next: int = 1
    waiting: dict[int, tuple[Record, Work]] = field(default_factory=dict)
    gap_since: float = 0.0  # when a later request arrived while `next` was missing


class Turns:
    """The trainer thread and every client's queue."""

    def __init__(self, threads: int = 1) -> None:
        self.threads = threads  # the trainer's torch threads, on its own thread
        self._queues: dict[str, Queue] = {}
        self._order: list[str] = []  # clients in round-robin order
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="orbit-serve-trainer", daemon=True)
        self._thread.start()

    def open(self, client: str, first: int = 1) -> None:
        with self._cond:
            self._queues.setdefault(client, Queue(next=first))
            if client not in self._order:
                self._order.append(client)

    def submit(self, client: str, seq_id: int, record: Record, work: Work) -> Record:
        """Queue `work` as request `seq_id` of `client` (0: after the last one queued); a request
        already queued under that number keeps its future (a resubmission), which is returned."""
        with self._cond:
            queue = self._queues.get(client)
            if queue is None:
                raise RequestFailed(f"no training client {client!r}", "user")
            if seq_id <= 0:
                seq_id = max([queue.next - 1, *queue.waiting]) + 1
            if seq_id in queue.waiting:
                return queue.waiting[seq_id][0]
            if seq_id < queue.next:
                raise RequestFailed(
                    f"seq_id {seq_id} of {client}: that request already ran (next is {queue.next})",
                    "user",
                )
            queue.waiting[seq_id] = (record, work)
            if queue.next not in queue.waiting and not queue.gap_since:
                queue.gap_since = time.monotonic()
            self._cond.notify_all()
        return record

    def skip(self, client: str, seq_id: int) -> None:
        """Request `seq_id` of `client` was refused before it was queued: the ones after it need
        not wait for it."""
        if seq_id <= 0:
            return
        skipped = Record(f"skipped-{client}-{seq_id}", "Skipped", False, "")
        try:
            self.submit(client, seq_id, skipped, lambda: None)
        except RequestFailed:
            pass  # already ran, or no such client: nothing waits for it

    def run_now(self, record: Record, work: Work) -> Record:
        """Work outside any client's order (creating a client), on the trainer thread, next."""
        with self._cond:
            now = self._queues.setdefault("", Queue())
            now.waiting[max(now.waiting, default=0) + 1] = (record, work)
            if "" not in self._order:
                self._order.insert(0, "")
            self._cond.notify_all()
        return record

    def pending(self, client: str) -> int:
        with self._cond:
            queue = self._queues.get(client)
            return len(queue.waiting) if queue else 0

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(30)

    def _next(self) -> tuple[Record, Work] | None:
        """The next request to run (the caller holds the lock), round-robin over ready clients."""
        for i, client in enumerate(self._order):
            queue = self._queues[client]
            if client == "" and queue.waiting:
                return queue.waiting.pop(min(queue.waiting))
            if queue.next in queue.waiting:
                job = queue.waiting.pop(queue.next)
                queue.next += 1
                queue.gap_since = time.monotonic() if queue.waiting else 0.0
                self._order.append(self._order.pop(i))  # its turn is over
                return job
            if queue.waiting and queue.gap_since and time.monotonic() - queue.gap_since > GAP_S:
                self._fail_gap(client, queue)
        return None

    def _fail_gap(self, client: str, queue: Queue) -> None:
        why = (
            f"request {queue.next} of {client} never arrived within {GAP_S:g} s; the requests "
            "after it cannot run in order"
        )
        for record, _ in queue.waiting.values():
            record.future.set_exception(RequestFailed(why, "user"))
        queue.next = max(queue.waiting) + 1
        queue.waiting.clear()
        queue.gap_since = 0.0

    def _run(self) -> None:
        compute_threads(self.threads)
        while True:
            with self._cond:
                job = self._next()
                while job is None and not self._stop:
                    self._cond.wait(1.0)
                    job = self._next()
                if self._stop:
                    return
            assert job is not None
            record, work = job
            try:
                record.future.set_result(work())
            except RequestFailed as err:
                record.future.set_exception(err)
            except Refused as err:
                record.future.set_exception(RequestFailed(str(err), "user"))
            except Exception as err:  # noqa: BLE001 - one request's failure is that request's
                record.future.set_exception(RequestFailed(f"{type(err).__name__}: {err}", "server"))
