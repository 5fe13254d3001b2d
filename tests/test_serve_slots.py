"""One engine's slots under `orbit serve` (orbit/serve/samplers.py `SlotCache`), a unit test of that
piece: which slot a request runs on, and the inflight flip (a newer version loaded beside the one
serving, requests moving to it, the old slot freed once its last request ends). The engine here
only records what is written into its slots; tests/test_tinker.py drives the same through the SDK
on real engines."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from orbit.serve.samplers import SamplingError, SlotCache, Weights


class Slots:
    """What a cache needs of an engine: `load_adapter`, recorded; `gate` holds loads while clear."""

    def __init__(self) -> None:
        self.loads: list[tuple[int, str]] = []
        self.gate = threading.Event()
        self.gate.set()

    def load_adapter(self, slot: int, tensors: dict, config: dict, version: int) -> float:
        assert self.gate.wait(10)
        self.loads.append((slot, tensors["w"].item()))
        return 0.0


def weights(key: str, version: int = 0, floor: int = 0) -> Weights:
    return Weights(key, {"w": torch.tensor(float(version))}, {}, version, floor)


def test_a_request_runs_on_the_slot_that_holds_its_weights():
    cache = SlotCache(Slots(), 2)
    a, b = cache.acquire(weights("a")), cache.acquire(weights("b"))
    assert {a, b} == {0, 1} and cache.acquire(weights("a")) == a
    assert cache.engine.loads == [(0, 0.0), (1, 0.0)]  # each loaded once
    cache.release(a)
    cache.release(a)
    assert cache.acquire(weights("c")) == a  # the idle slot, b's being busy


def test_an_inflight_publish_flips_without_draining_the_running_request():
    cache = SlotCache(Slots(), 3)
    old = cache.acquire(weights("t", 1, floor=1))  # a request runs on v1
    cache.prepare(weights("t", 2))  # the publish: v2 into an idle slot, beside it
    new = cache.acquire(weights("t", 2, floor=1))  # an existing session's next request
    assert new != old and cache.versions[new] == 2 and cache.flips == 1
    assert cache.held[old] == "t" and cache.running[old] == 1  # still running on v1
    cache.release(old)
    assert cache.held[old] is None  # free once its last request ended
    assert cache.serving() == {"t": 2}


def test_a_session_never_runs_older_than_it_was_created_at():
    slots = Slots()
    cache = SlotCache(slots, 3)
    cache.release(cache.acquire(weights("t", 1, floor=1)))
    slots.gate.clear()  # v2's load is slow
    with ThreadPoolExecutor(2) as pool:
        loading = pool.submit(cache.prepare, weights("t", 2))
        while not cache._loading:
            threading.Event().wait(0.01)
        # an old session goes on with v1 while v2 loads; a session made at v2 waits for it
        assert cache.versions[cache.acquire(weights("t", 2, floor=1))] == 1
        waiting = pool.submit(cache.acquire, weights("t", 2, floor=2))
        threading.Event().wait(0.2)
        assert not waiting.done()
        slots.gate.set()
        assert cache.versions[waiting.result(10)] == 2
        loading.result(10)


def test_a_publish_finding_no_idle_slot_leaves_the_load_to_the_next_request():
    cache = SlotCache(Slots(), 2)
    t1 = cache.acquire(weights("t", 1, floor=1))
    other = cache.acquire(weights("other"))
    cache.prepare(weights("t", 2))  # both slots busy: nothing loaded
    assert cache.serving() == {"t": 1, "other": 0}
    cache.release(other)
    again = cache.acquire(weights("t", 2, floor=1))  # loads v2 into the freed slot
    assert again == other and cache.versions[again] == 2
    cache.release(t1)
    assert cache.serving() == {"t": 2}


def test_every_slot_busy_is_a_refusal_after_the_bound():
    cache = SlotCache(Slots(), 1)
    cache.acquire(weights("a"))
    with pytest.raises(SamplingError, match="adapter slots stayed busy"):
        cache.acquire(weights("b"), wait_s=0.1)
