"""The trainer's turns: every training client's requests, each client's in `seq_id` order, run on
one thread. A client's next request runs as soon as it is there; among clients with one ready,
turns go round, so no client waits behind another's whole queue.

Packs. A forward or forward_backward (`Packable`) shares its pass over the base with the other
clients' of the same kind ready at the same time (orbit/train/packing.py): the pack takes, in the
round's order, each ready client's next request while their tokens stay within `pack_tokens` (the
first one whatever its size), and every client in it goes to the end of the round. So a request
that did not fit is first in the next pack (it waits at most one pack for a place), and a huge
request takes a pack of its own rather than holding small ones back. Clients in step (each sends
forward_backward, then optim_step once it is answered, then the next) would take turns forever, one
forward_backward a pass, so a pack about to form first lets each other client's ready request that
cannot join it run (once each: an optim_step is quick), and waits up to LINGER_S for a client that
was answered just now and whose last request came within LINGER_S of the answer before it, or that
had no answer before it (its next is on its way; an RL loop that samples between steps does not
hold packs back). `pack_tokens` 0: one request a turn.

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
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from orbit.host.threads import compute_threads
from orbit.serve.futures import Record, Refused, RequestFailed

RAN_KEPT = 4  # a client's newest requests that ran, kept for the SDK's resend of its newest
PACKS_KEPT = 500  # the newest packs, for the page
# A pack forming waits this long at most for a client answered just now: its next request is on
# its way (the SDK sends a client's next request once the one before is answered)
LINGER_S = 0.1
Work = Callable[[], Any]  # the request's work; its return value is the future's result


@dataclass
class Packable:
    """A request that may share a pass with other clients' of its `kind`: `request` goes to the
    pack runner with the others', and `finish` makes its result the future's."""

    kind: str
    tokens: int
    request: Any
    finish: Callable[[Any], Any]


# the requests of a pack -> each one's result, or the exception that is its answer
PackRunner = Callable[[list[Any]], list[Any]]


@dataclass(frozen=True)
class Pack:
    """One pass's worth of packed requests, for the page."""

    clients: int
    tokens: int
    seconds: float
    at: float  # when it ended (time.time())


@dataclass
class Queue:
    """One client's requests: seq_id -> (future, work)."""

    next: int = 1  # the lowest number that may still run: one past the last that ran
    waiting: dict[int, tuple[Record, Work | Packable]] = field(default_factory=dict)
    # the newest that ran, so that the SDK's retry of one whose answer it lost gets its future
    ran: OrderedDict[int, Record] = field(default_factory=OrderedDict)
    # requests without a number (seq_id 0: unload_model, a raw client's): each after the numbered
    # ones that arrived before it, taking no number the SDK will send
    unnumbered: deque[tuple[int, Record, Work | Packable]] = field(default_factory=deque)

    def head(self) -> int | None:
        """The number of the next job (-1: an unnumbered one); None when nothing waits."""
        first = min(self.waiting, default=None)
        if self.unnumbered and (first is None or self.unnumbered[0][0] < first):
            return -1
        return first


class Turns:
    """The trainer thread and every client's queue; `run_pack` computes a pack of `Packable`
    requests (one alone too, with `pack_tokens` 0). `linger_s`: how long a pack forming waits for
    a client on its way (LINGER_S)."""

    def __init__(
        self,
        threads: int = 1,
        pack_tokens: int = 0,
        run_pack: PackRunner | None = None,
        linger_s: float = LINGER_S,
    ) -> None:
        self.threads = threads  # the trainer's torch threads, on its own thread
        self.pack_tokens = pack_tokens
        self.linger_s = linger_s
        self._run_pack = run_pack
        self.packs: deque[Pack] = deque(maxlen=PACKS_KEPT)
        self._queues: dict[str, Queue] = {}
        self._order: list[str] = []  # clients in round-robin order
        self._cond = threading.Condition()
        self._stop = False
        # packing (_next): the clients whose quick request ran before the pack forming now, when
        # it began to wait for clients on their way, and when each client was last answered
        self._quick: set[str] = set()
        self._linger_from = 0.0
        self._answered: dict[str, float] = {}
        # how soon after its last answer each client's newest request arrived
        self._gap: dict[str, float] = {}
        self._thread = threading.Thread(target=self._run, name="orbit-serve-trainer", daemon=True)
        self._thread.start()

    def open(self, client: str) -> None:
        with self._cond:
            self._queues.setdefault(client, Queue())
            if client not in self._order:
                self._order.append(client)

    def submit(self, client: str, seq_id: int, record: Record, work: Work | Packable) -> Record:
        """Queue `work` as request `seq_id` of `client` (0 or less: unnumbered, after what arrived
        before it); a request already queued or run under that number keeps its future (a
        resubmission), which is returned. RequestFailed when it cannot be queued."""
        with self._cond:
            queue = self._queues.get(client)
            if queue is None:
                raise RequestFailed(f"no training client {client!r}", "user")
            if client in self._answered:
                self._gap[client] = time.monotonic() - self._answered[client]
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

    def _next(self, now: float) -> list[tuple[str, Record, Work | Packable]] | float:
        """The next requests to run (the caller holds the lock): one, or a pack of Packables
        (round-robin over ready clients), or the seconds to wait for a pack's other members."""
        special = self._special()
        if special:
            return special
        heads = [(c, h) for c in self._order if c and (h := self._queues[c].head()) is not None]
        if not heads:
            return []
        client, seq_id = heads[0]
        if (
            not isinstance(self._queues[client].waiting[seq_id][1], Packable)
            or not self.pack_tokens
        ):
            return self._ran([(client, self._take(self._queues[client], seq_id))])
        # Before the pack: every other client's ready request that cannot join it, once each (an
        # optim_step: quick, and its client's next forward_backward can then join the pack)
        for other, other_seq in heads[1:]:
            queue = self._queues[other]
            if not isinstance(queue.waiting[other_seq][1], Packable) and other not in self._quick:
                self._quick.add(other)
                return self._ran([(other, self._take(queue, other_seq))])
        # ...and a client just answered, whose next request is on its way, at most linger_s
        on_way = [
            c
            for c, at in self._answered.items()
            if now - at < self.linger_s
            and self._gap.get(c, 0.0) < self.linger_s  # a new client counts as in step
            and c in self._queues
            and self._queues[c].head() is None
        ]
        if on_way:
            self._linger_from = self._linger_from or now
            if now - self._linger_from < self.linger_s:
                return self._linger_from + self.linger_s - now
        self._linger_from, self._quick = 0.0, set()
        first = self._queues[client].waiting[seq_id][1]
        later = self._order[self._order.index(client) + 1 :]
        assert isinstance(first, Packable)
        return self._ran(
            [(client, self._take(self._queues[client], seq_id)), *self._fill(first, later)]
        )

    def _special(self) -> list[tuple[str, Record, Work | Packable]]:
        """Work outside the clients' order (run_now), or a client's unnumbered request, first."""
        now = self._queues.get("")
        if now is not None and now.waiting:
            return [("", *now.waiting.pop(min(now.waiting)))]
        for client in self._order:
            queue = self._queues[client]
            if client and queue.head() == -1:
                _, record, work = queue.unnumbered.popleft()
                return self._ran([(client, (record, work))])
        return []

    def _ran(
        self, jobs: list[tuple[str, tuple[Record, Work | Packable]]]
    ) -> list[tuple[str, Record, Work | Packable]]:
        """`jobs` taken: their clients' turns are over, to the end of the round in their order."""
        taken = [c for c, _ in jobs]
        self._order = [c for c in self._order if c not in taken] + taken
        return [(c, record, work) for c, (record, work) in jobs]

    def _take(self, queue: Queue, seq_id: int) -> tuple[Record, Work | Packable]:
        job = queue.waiting.pop(seq_id)
        queue.next = seq_id + 1
        queue.ran[seq_id] = job[0]
        if len(queue.ran) > RAN_KEPT:
            queue.ran.popitem(last=False)
        return job

    def _fill(
        self, first: Packable, later: list[str]
    ) -> list[tuple[str, tuple[Record, Work | Packable]]]:
        """The next requests of the clients `later` in the round that join `first`'s pack, in the
        round's order: of its kind, within pack_tokens."""
        tokens: int = first.tokens
        out: list[tuple[str, tuple[Record, Work | Packable]]] = []
        for client in later:
            queue = self._queues[client]
            seq_id = queue.head()
            if seq_id is None or seq_id == -1:
                continue
            work = queue.waiting[seq_id][1]
            if not isinstance(work, Packable) or work.kind != first.kind:
                continue
            if tokens + work.tokens > self.pack_tokens:
                continue  # first in the next pack: the clients in this one go behind it
            tokens += work.tokens
            out.append((client, self._take(queue, seq_id)))
        return out

    def _run(self) -> None:
        compute_threads(self.threads)
        while True:
            with self._cond:
                while True:
                    if self._stop:
                        return
                    jobs = self._next(time.monotonic())
                    if isinstance(jobs, float):
                        self._cond.wait(jobs)
                    elif jobs:
                        break
                    else:
                        self._cond.wait(1.0)
            packed = [(r, w) for _, r, w in jobs if isinstance(w, Packable)]
            if packed:  # a pack holds Packables only
                self._pack(packed)
            else:
                _, record, work = jobs[0]
                assert not isinstance(work, Packable)
                _answer(record, work)
            with self._cond:
                for client, _, _ in jobs:
                    self._answered[client] = time.monotonic()
                for client in [c for c in self._answered if c not in self._queues]:
                    del self._answered[client]  # closed
                    self._gap.pop(client, None)

    def _pack(self, jobs: list[tuple[Record, Packable]]) -> None:
        """Run packed requests together; each gets its own result or its own failure."""
        assert self._run_pack is not None, "Packable work needs a pack runner"
        t0 = time.perf_counter()
        try:
            results = self._run_pack([work.request for _, work in jobs])
        except Exception as err:  # noqa: BLE001 - the pass failed: every request in it did
            results = [err] * len(jobs)
        self.packs.append(
            Pack(
                len(jobs),
                sum(work.tokens for _, work in jobs),
                time.perf_counter() - t0,
                time.time(),
            )
        )
        for (record, work), result in zip(jobs, results, strict=True):
            if isinstance(result, BaseException):
                _answer(record, partial(_raise, result))
            else:
                _answer(record, partial(work.finish, result))


def _raise(err: BaseException) -> None:
    raise err


def _answer(record: Record, work: Work) -> None:
    """Set the future to what `work` gives, or to the failure it raises."""
    try:
        record.future.set_result(work())
    except RequestFailed as err:
        record.future.set_exception(err)
    except Refused as err:
        record.future.set_exception(RequestFailed(str(err), "user"))
    except Exception as err:  # noqa: BLE001 - one request's failure is that request's
        record.future.set_exception(RequestFailed(f"{type(err).__name__}: {err}", "server"))
