"""The trainer's turns: every training client's requests, each client's in `seq_id` order, run on
one thread (the base computes for one adapter at a time). A client's next request runs as soon as it
is there; among clients with one ready, turns go round, so no client waits behind another's whole
queue.

The SDK numbers a client's requests from 1 and sends each only once the one before it was answered
(its `_take_turn`); the chunks of one forward_backward would go at once, the first last, but
Orbit's client config turns that off (`parallel_fwdbwd_chunks`). So when request n arrives, every
number below it either arrived or never will: the SDK took it and gave up before sending (its own
check refused the call), or the server refused it. A missing number holds nothing; the requests run
in the order of their numbers, and one that arrives behind a later one that already ran is refused
by name.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from orbit.host.threads import compute_threads
from orbit.serve.futures import Record, Refused, RequestFailed

RAN_KEPT = 4  # a client's newest requests that ran, kept for the SDK's resend of its newest
Work = Callable[[], Any]  # the request's work; its return value is the future's result


@dataclass
class Queue:
    """One client's requests: seq_id -> (future, work)."""

    next: int = 1  # the lowest number that may still run: one past the last that ran
    waiting: dict[int, tuple[Record, Work]] = field(default_factory=dict)
    # the newest that ran, so that the SDK's retry of one whose answer it lost gets its future
    ran: OrderedDict[int, Record] = field(default_factory=OrderedDict)
    # requests without a number (seq_id 0: unload_model, a raw client's): each after the numbered
    # ones that arrived before it, taking no number the SDK will send
    unnumbered: deque[tuple[int, Record, Work]] = field(default_factory=deque)

    def head(self) -> int | None:
        """The number of the next job (-1: an unnumbered one); None when nothing waits."""
        first = min(self.waiting, default=None)
        if self.unnumbered and (first is None or self.unnumbered[0][0] < first):
            return -1
        return first


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

    def open(self, client: str) -> None:
        with self._cond:
            self._queues.setdefault(client, Queue())
            if client not in self._order:
                self._order.append(client)

    def submit(self, client: str, seq_id: int, record: Record, work: Work) -> Record:
        """Queue `work` as request `seq_id` of `client` (0 or less: unnumbered, after what arrived
        before it); a request already queued or run under that number keeps its future (a
        resubmission), which is returned. RequestFailed when it cannot be queued."""
        with self._cond:
            queue = self._queues.get(client)
            if queue is None:
                raise RequestFailed(f"no training client {client!r}", "user")
            if seq_id <= 0:
                queue.unnumbered.append((max([queue.next - 1, *queue.waiting]), record, work))
                self._cond.notify_all()
                return record
            if seq_id in queue.waiting:
                return queue.waiting[seq_id][0]
            if seq_id in queue.ran:
                return queue.ran[seq_id]
            if seq_id < queue.next:
                raise RequestFailed(
                    f"seq_id {seq_id} of {client} arrived after request {queue.next - 1} ran: "
                    "a client's requests run in the order of their numbers",
                    "user",
                )
            queue.waiting[seq_id] = (record, work)
            self._cond.notify_all()
        return record

    def close(self, client: str, why: str) -> None:
        """The client is gone: its waiting requests fail with `why`, and later ones are refused."""
        with self._cond:
            queue = self._queues.pop(client, None)
            if client in self._order:
                self._order.remove(client)
        jobs = [*queue.waiting.values(), *((r, w) for _, r, w in queue.unnumbered)] if queue else []
        for record, _ in jobs:
            record.future.set_exception(RequestFailed(why, "user"))

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
            return len(queue.waiting) + len(queue.unnumbered) if queue else 0

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
            seq_id = queue.head()  # the lowest that arrived: a number missing below it never comes
            if seq_id == -1:
                _, record, work = queue.unnumbered.popleft()
                self._order.append(self._order.pop(i))
                return record, work
            if seq_id is not None:
                job = queue.waiting.pop(seq_id)
                queue.next = seq_id + 1
                queue.ran[seq_id] = job[0]
                if len(queue.ran) > RAN_KEPT:
                    queue.ran.popitem(last=False)
                self._order.append(self._order.pop(i))  # its turn is over
                return job
        return None

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
