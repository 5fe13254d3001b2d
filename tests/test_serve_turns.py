"""The trainer's turns of `orbit serve` (orbit/serve/training.py), one piece on its own: each
client's requests run in seq_id order whatever order they arrive in, clients take turns, a request
that never comes fails those behind it with the reason, and a failure says whose fault it is. The
whole service against the real SDK: tests/test_tinker.py."""

from __future__ import annotations

import threading
import time

import pytest

from orbit.serve import training
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


def test_chunks_sent_out_of_order_run_in_seq_id_order(turns, store):
    futures, ran = Futures(store), []
    turns.open("a")
    records = {}
    for seq in (3, 1, 2):  # the SDK's chunks of one forward_backward, the first arriving last
        record = futures.new("ForwardBackward", "a")
        records[seq] = turns.submit("a", seq, record, lambda s=seq: ran.append(s) or s)
    assert [_result(records[s]) for s in (1, 2, 3)] == [1, 2, 3]
    assert ran == [1, 2, 3]


def test_a_resubmitted_request_keeps_its_future_and_a_past_one_is_refused(turns, store):
    futures, gate = Futures(store), threading.Event()
    turns.open("a")
    first = turns.submit("a", 2, futures.new("x", "a"), lambda: "two")  # waits for 1
    assert turns.submit("a", 2, futures.new("x", "a"), lambda: "again") is first
    turns.submit("a", 1, futures.new("x", "a"), gate.wait)
    gate.set()
    assert _result(first) == "two"
    with pytest.raises(RequestFailed, match="seq_id 1 of a: that request already ran"):
        turns.submit("a", 1, futures.new("x", "a"), lambda: None)


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


def test_a_request_that_never_comes_fails_those_behind_it(turns, store, monkeypatch):
    monkeypatch.setattr(training, "GAP_S", 0.3)
    futures = Futures(store)
    turns.open("a")
    behind = turns.submit("a", 2, futures.new("x", "a"), lambda: "two")
    with pytest.raises(RequestFailed, match="request 1 of a never arrived within 0.3 s") as err:
        _result(behind)
    assert err.value.category == "user"
    after = turns.submit("a", 3, futures.new("x", "a"), lambda: "three")  # the client goes on
    assert _result(after) == "three"


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
