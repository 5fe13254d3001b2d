"""The trainer's turns of `orbit serve` (orbit/serve/training.py), one piece on its own: each
client's requests run in seq_id order, a number never sent holds nothing, one arriving behind a
later one that ran is refused by name, clients take turns, and a failure says whose fault it is.
The whole service against the real SDK (its own refusals included): tests/test_tinker.py."""

from __future__ import annotations

import threading
import time

import pytest

from orbit.serve.futures import Futures, Refused, RequestFailed
from orbit.serve.store import Store
from orbit.serve.training import Turns


@pytest.fixture
def turns():
    t = Turns()
    yield t
    t.stop()


@pytest.fixture
def store(tmp_path):
    s = Store(f"sqlite:///{tmp_path / 'serve.db'}")
    yield s
    s.close()


def _result(record, timeout: float = 10.0):
    return record.future.result(timeout=timeout)


def test_requests_queued_together_run_in_seq_id_order(turns, store):
    futures, ran, gate = Futures(store), [], threading.Event()
    turns.open("a")
    blocker = turns.run_now(futures.new("create", "a"), gate.wait)  # hold the thread meanwhile
    records = {}
    for seq in (3, 1, 2):
        work = lambda s=seq: ran.append(s) or s  # noqa: E731
        records[seq] = turns.submit("a", seq, futures.new("x", "a"), work)
    gate.set()
    _result(blocker)
    assert [_result(records[s]) for s in (1, 2, 3)] == [1, 2, 3]
    assert ran == [1, 2, 3]


def test_a_resubmitted_request_keeps_its_future_and_a_past_one_is_refused(turns, store):
    """The SDK sends a request again when its answer was lost: waiting or run, it gets the same
    future; a number below one that ran is refused by name."""
    futures, gate = Futures(store), threading.Event()
    turns.open("a")
    blocker = turns.run_now(futures.new("create", "a"), gate.wait)
    first = turns.submit("a", 2, futures.new("x", "a"), lambda: "two")
    assert turns.submit("a", 2, futures.new("x", "a"), lambda: "again") is first  # waiting
    gate.set()
    _result(blocker)
    assert _result(first) == "two"
    assert turns.submit("a", 2, futures.new("x", "a"), lambda: "again") is first  # it ran
    with pytest.raises(RequestFailed, match="seq_id 1 of a arrived after request 2 ran"):
        turns.submit("a", 1, futures.new("x", "a"), lambda: None)


def test_a_request_without_a_number_runs_after_those_before_it_and_takes_none(turns, store):
    """unload_model (and a raw client's request) has no seq_id: it runs after what arrived before
    it, and the SDK's next number is still its own request's."""
    futures, ran, gate = Futures(store), [], threading.Event()
    turns.open("a")
    blocker = turns.run_now(futures.new("create", "a"), gate.wait)
    one = turns.submit("a", 1, futures.new("x", "a"), lambda: ran.append(1))
    unload = turns.submit("a", 0, futures.new("x", "a"), lambda: ran.append("unload"))
    two = turns.submit("a", 2, futures.new("x", "a"), lambda: ran.append(2))
    assert len({id(one), id(unload), id(two)}) == 3
    gate.set()
    for record in (blocker, one, unload, two):
        _result(record)
    assert ran == [1, "unload", 2]


def test_clients_take_turns(turns, store):
    futures, ran, gate = Futures(store), [], threading.Event()
    turns.open("a")
    turns.open("b")
    blocker = turns.run_now(
        futures.new("create", "a"), gate.wait
    )  # hold the thread while both queue
    last = None
    for seq in (1, 2, 3):
        turns.submit("a", seq, futures.new("x", "a"), lambda s=seq: ran.append(f"a{s}"))
        last = turns.submit("b", seq, futures.new("x", "a"), lambda s=seq: ran.append(f"b{s}"))
    gate.set()
    _result(blocker)
    _result(last)
    assert ran == ["a1", "b1", "a2", "b2", "a3", "b3"]


def test_a_number_never_sent_holds_nothing(turns, store):
    """The SDK took number 1 and refused the call itself: 2 runs at once, and 1 arriving after all
    (no SDK does) is refused by name, not run out of order."""
    futures = Futures(store)
    turns.open("a")
    t0 = time.monotonic()
    assert _result(turns.submit("a", 2, futures.new("x", "a"), lambda: "two")) == "two"
    assert time.monotonic() - t0 < 5
    with pytest.raises(RequestFailed, match="seq_id 1 of a arrived after request 2 ran") as err:
        turns.submit("a", 1, futures.new("x", "a"), lambda: "one")
    assert err.value.category == "user"
    assert _result(turns.submit("a", 5, futures.new("x", "a"), lambda: "five")) == "five"


def test_a_failure_says_whose_it_is(turns, store):
    futures = Futures(store)
    turns.open("a")

    def refused():
        raise Refused("loss_fn 'dro': not served")

    def broken():
        raise RuntimeError("out of memory")

    mine = turns.submit("a", 1, futures.new("x", "a"), refused)
    theirs = turns.submit("a", 2, futures.new("x", "a"), broken)
    for record, category, text in ((mine, "user", "dro"), (theirs, "server", "RuntimeError")):
        with pytest.raises(RequestFailed, match=text) as err:
            _result(record)
        assert err.value.category == category


@pytest.mark.alone  # a time bound: no other test beside it
def test_a_poll_waits_for_the_result_up_to_its_bound(store):
    import asyncio

    futures = Futures(store)
    record = futures.new("x", "a")
    start = time.monotonic()
    assert asyncio.run(futures.wait(record, seconds=0.2)) is False
    assert 0.15 < time.monotonic() - start < 5
    threading.Timer(0.1, record.future.set_result, args=("done",)).start()
    assert asyncio.run(futures.wait(record, seconds=10)) is True
