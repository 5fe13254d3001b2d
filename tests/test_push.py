"""Unit tests of the push (orbit/push/) and the slot gate: the phases, the ring's slot choice, the
updaters (latest wins, refusals reported, dead engines dropped), the barrier and the flip clock. An
engine double records the calls; the end-to-end tests run the real engines."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from engine_helpers import FakeEngine

from orbit.engine.base import Capabilities, EngineDeadError, EngineError, SamplingParams
from orbit.engine.pool import EnginePool
from orbit.engine.sglang.gate import SlotGate
from orbit.push.fleet import FleetPush
from orbit.push.phases import (
    AdapterPush,
    DoubleBufferPush,
    FullPush,
    MergedPush,
    Target,
    make_push,
    run_phases,
)
from orbit.run.revive import Revival


class Policy:
    """What a push reads of a policy version."""

    def __init__(self, version: int) -> None:
        self.version = version

    def adapter_tensors(self) -> dict:
        return {"w": self.version}

    def adapter_config(self) -> dict:
        return {}

    def merged_weights(self, only_adapted: bool = False) -> dict:
        return {"w": self.version}


def _kinds(engine: FakeEngine) -> list:
    return [c[0] if c[0] != "load_adapter" else ("load", c[1]) for c in engine.calls]


def test_double_buffer_writes_the_inactive_slot_while_serving_then_flips():
    engine = FakeEngine(slots=2)
    push = make_push("double-buffer", "lora", engine.capabilities)
    push.initial(engine, Policy(0))
    engine.calls.clear()
    run_phases([Target(push, engine)], Policy(1), None)
    assert _kinds(engine) == [
        ("load", 1),
        "pause_generation",
        "flush_cache",
        "activate",
        "continue_generation",
    ]
    assert engine.calls[1] == ("pause_generation", "in_place") and engine.calls[3] == (
        "activate",
        1,
    )
    engine.active_slot = 1
    engine.calls.clear()
    run_phases([Target(push, engine)], Policy(2), None)
    assert _kinds(engine)[0] == ("load", 0)  # back to slot 0: the ring of two


def test_the_ring_skips_slots_with_requests_and_reuses_the_one_inactive_longest():
    push, engine = DoubleBufferPush(slots=4), FakeEngine(slots=4)
    push.initial(engine, Policy(0))
    assert push.choose_slot(0, (0, 0, 0, 0)) == 1
    push.target = 1
    push.apply(engine, Policy(1), None)  # active 1; slot 0 deactivated at flip 1
    assert push.choose_slot(1, (0, 0, 0, 0)) == 2  # never used: inactive longest
    assert push.choose_slot(1, (0, 0, 3, 0)) == 3  # slot 2 still has requests of its own
    # all busy: the one inactive longest (its requests wait or abort)
    assert push.choose_slot(1, (5, 0, 5, 5)) == 2
    push.target = 2
    push.apply(engine, Policy(2), None)
    assert push.choose_slot(2, (0, 0, 0, 0)) == 3 and push.choose_slot(2, (0, 0, 0, 5)) == 0


def test_an_adapter_push_on_sglang_loads_while_generation_runs():
    engine = FakeEngine()
    caps = engine.capabilities
    engine.capabilities = type(caps)(
        slots=2, oft_slots=False, loads_while_paused=False, flush_while_running=False
    )
    push = make_push("adapter", "lora", engine.capabilities)
    run_phases([Target(push, engine)], Policy(1), None)
    # no pause: the slot's requests finish first, new ones wait
    assert _kinds(engine) == [("load", 0)]


def test_make_push_follows_adapter_type_and_engine_capabilities():
    # what the embedded engine and SGLang declare (EmbeddedClient, SGLangEngine)
    embedded = Capabilities(
        slots=3, oft_slots=True, loads_while_paused=True, flush_while_running=True
    )
    sglang = Capabilities(
        slots=2, oft_slots=False, loads_while_paused=False, flush_while_running=False
    )
    for engine in (embedded, sglang):
        for kind in ("lora", "oft"):
            assert type(make_push("full", kind, engine)) is FullPush
        assert type(make_push("adapter", "lora", engine)) is AdapterPush
        assert type(make_push("double-buffer", "lora", engine)) is DoubleBufferPush
    assert type(make_push("double-buffer", "oft", embedded)) is DoubleBufferPush
    assert type(make_push("adapter", "oft", embedded)) is AdapterPush
    for push in ("adapter", "double-buffer"):
        assert type(make_push(push, "oft", sglang)) is MergedPush
    assert make_push("adapter", "lora", embedded).load_while_paused
    assert not make_push("adapter", "lora", sglang).load_while_paused
    ring = make_push("double-buffer", "lora", embedded)
    assert ring.flush and ring.slots == 3
    assert not make_push("double-buffer", "lora", sglang).flush


def _fleet(
    n: int = 2, flip: str = "independent", **kw
) -> tuple[EnginePool, FleetPush, list[FakeEngine]]:
    engines = [FakeEngine() for _ in range(n)]
    pool = EnginePool(engines, [8] * n, monitor=False)
    push = FleetPush("double-buffer", "lora", pool, flip, **kw)
    push.initial(Policy(0))
    return pool, push, engines


def _wait(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_independent_updaters_return_at_once_and_each_engine_serves_the_new_version():
    pool, push, engines = _fleet()
    result = push.push(Policy(1))
    assert result.flipped and result.paused_s == 0.0
    _wait(lambda: pool.versions() == [1, 1])
    _wait(lambda: push.flip_lag() is not None)
    assert push.flip_lag()[0] == 1
    push.finish()


def test_an_engine_busy_with_one_version_skips_to_the_newest():
    pool, push, engines = _fleet(1)
    inside, gate = threading.Event(), threading.Event()
    real_load = engines[0].load_adapter

    def slow_load(slot, tensors, config, version):
        inside.set()
        gate.wait(5)
        return real_load(slot, tensors, config, version)

    engines[0].load_adapter = slow_load
    engines[0].calls.clear()
    push.push(Policy(1))
    assert inside.wait(5)  # the engine is busy with version 1 ...
    for v in (2, 3):  # ... while 2 and 3 arrive
        push.push(Policy(v))
    gate.set()
    _wait(lambda: pool.versions() == [3])
    push.finish()
    # 2 was skipped: latest wins
    assert [c[2] for c in engines[0].calls if c[0] == "load_adapter"] == [1, 3]


def test_a_refused_push_is_warned_and_the_run_stops_only_when_refusals_repeat():
    warnings: list[str] = []
    pool, push, engines = _fleet()
    pool.on_warning = warnings.append
    real_load = engines[0].load_adapter

    def refuse(*args):
        raise EngineError("bad adapter")

    def die(*args):
        raise EngineDeadError("engine process 7 died")

    engines[0].load_adapter, engines[1].load_adapter = refuse, die
    push.push(Policy(1))
    _wait(lambda: not pool.members[1].alive and all(u.idle() for u in push.updaters))
    assert "died" in pool.members[1].reason and ("kill",) in engines[1].calls
    assert pool.versions() == [0, None] and push.refusals == 1  # engine 0 serves what it had
    assert "engine 0 refused the push of v1 and serves v0: bad adapter" in warnings
    engines[0].load_adapter = real_load  # a passing fault: the next push goes through
    push.push(Policy(2))
    _wait(lambda: pool.versions()[0] == 2)
    engines[0].load_adapter = refuse
    for v in (3, 4, 5):
        push.push(Policy(v))
        _wait(lambda: push.updaters[0].idle())
    with pytest.raises(
        EngineError, match="engine 0 refused 3 pushes in a row; the last: bad adapter"
    ):
        push.push(Policy(6))
    push.stop()


@pytest.mark.alone  # a time bound: no other test beside it
def test_a_serial_push_an_engine_refuses_stops_at_once():
    pool, push, engines = _fleet(wait_all=True, wait_s=30)

    def refuse(*args):
        raise EngineError("bad adapter")

    engines[1].load_adapter = refuse
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="bad adapter"):
        push.push(Policy(1))
    assert time.monotonic() - t0 < 5
    push.stop()


def test_the_barrier_runs_each_phase_on_every_engine_and_waits():
    pool, push, engines = _fleet(flip="barrier")
    for e in engines:
        e.calls.clear()
    result = push.push(Policy(1))
    assert pool.versions() == [1, 1] and result.paused_s >= 0 and push.flip_lag()[0] == 1
    for e in engines:
        assert _kinds(e) == [
            ("load", 1),
            "pause_generation",
            "flush_cache",
            "activate",
            "continue_generation",
        ]


def test_serial_pushes_wait_until_every_engine_serves_the_version():
    pool, push, engines = _fleet(wait_all=True, wait_s=0.5)
    push.push(Policy(1))
    assert pool.versions() == [1, 1]  # returned only once both serve it
    engines[0].load_adapter = lambda *a: time.sleep(2)
    with pytest.raises(
        EngineDeadError, match="did not take version 2 within 0.5 s: engine 0 at v1"
    ):
        push.push(Policy(2))
    push.stop()


def test_slot_gate_rewrites_a_slot_only_once_its_requests_are_gone():
    async def scenario():
        gate = SlotGate(2)
        log = []

        async def ok(*args):
            log.append("load")
            return True, ""

        async def unloaded():
            log.append("unload")
            return True, ""

        await gate.rewrite(0, 1, paused=False, load=ok, unload=unloaded, restore=ok, backup=())
        assert await gate.enter(0) == 1  # a request running on version 1
        rewrite = asyncio.ensure_future(
            gate.rewrite(0, 2, paused=False, load=ok, unload=unloaded, restore=ok, backup=())
        )
        await asyncio.sleep(0.05)
        held = asyncio.ensure_future(gate.enter(0))  # a new request waits for the new adapter
        await asyncio.sleep(0.05)
        assert not rewrite.done() and not held.done() and gate.requests() == (2, 0)
        gate.leave(0)  # the running request finishes on version 1
        await rewrite
        assert await held == 2 and log == ["load", "unload", "load"]
        gate.leave(0)
        # unloading under paused requests would hang
        with pytest.raises(EngineError, match="while paused"):
            await gate.rewrite(0, 3, paused=True, load=ok, unload=unloaded, restore=ok, backup=())

    asyncio.run(scenario())


# ---- engines that come back (orbit/run/revive.py) ------------------------------------------------


def _revived(n: int, restart, attached: bool = False, tries: int = 3, wait_s: float = 30.0):
    pool, push, engines = _fleet(n)
    revival = Revival(
        pool,
        push,
        restart,
        attached=attached,
        tries=tries,
        wait_s=wait_s,
        poll_s=0.05,
        backoff_s=0.01,
    )
    return pool, push, engines, revival


def test_a_dead_engine_is_restarted_brought_to_the_newest_version_and_rejoins():
    fresh = FakeEngine()
    pool, push, engines, revival = _revived(2, lambda i: fresh)
    push.push(Policy(1))
    _wait(lambda: pool.versions() == [1, 1])
    pool.drop(pool.members[1], "engine process 9 died")
    _wait(lambda: pool.rejoined == 1)
    assert pool.members[1].engine is fresh and pool.versions() == [1, 1]
    # v1 (into its first slot) before it serves anything
    assert _kinds(fresh)[:2] == [("load", 0), "activate"]
    push.push(Policy(2))  # and it flips with the others from then on
    _wait(lambda: pool.versions() == [2, 2])
    revival.stop()
    push.finish()


def test_requests_wait_while_the_only_engine_comes_back():
    gate = threading.Event()
    fresh = FakeEngine()

    def restart(i):
        gate.wait(5)
        return fresh

    pool, push, engines, revival = _revived(1, restart)
    pool.drop(pool.members[0], "did not answer for 5 s (hung)")
    held = pool.generate([1, 2], SamplingParams())
    pool.require_alive()  # no engine serves, but one is coming back: not the end
    assert not held.done() and "coming back" in pool.describe()
    gate.set()
    _wait(lambda: ("generate", "active") in fresh.calls)  # the held request went to the new engine
    revival.stop()
    pool.shutdown()


def test_an_engine_that_cannot_be_restarted_is_given_up_after_its_tries():
    def restart(i):
        raise RuntimeError("the device is gone")

    pool, push, engines, revival = _revived(1, restart, tries=2)
    warnings: list[str] = []
    pool.on_warning = warnings.append
    pool.drop(pool.members[0], "engine process 9 died")
    held = pool.generate([1], SamplingParams())
    with pytest.raises(
        EngineDeadError, match=r"engine process 9 died; not restarted after 2 tries \(RuntimeError"
    ):
        held.result(5)
    assert (
        sum("restart" in w and "failed: RuntimeError: the device is gone" in w for w in warnings)
        == 2
    )
    with pytest.raises(EngineDeadError):
        pool.require_alive()
    revival.stop()


def test_an_attached_server_is_taken_back_once_it_answers_and_given_up_after_the_stall_bound():
    answers = {"up": False}
    fresh = FakeEngine()

    def reattach(i):
        if not answers["up"]:
            raise RuntimeError("engine.servers: http://127.0.0.1:1: cannot be reached")
        return fresh

    pool, push, engines, revival = _revived(2, reattach, attached=True)
    pool.drop(pool.members[0], "did not answer for 5 s (hung)")
    time.sleep(0.3)  # polled, quietly, while the other engine serves
    assert pool.rejoined == 0 and pool.members[0].reviving
    answers["up"] = True
    _wait(lambda: pool.rejoined == 1)
    revival.stop()
    pool.shutdown()
    # with no engine left, a server that stays down is given up after the stall bound
    pool, push, engines, revival = _revived(1, lambda i: _down(), attached=True, wait_s=0.3)
    pool.drop(pool.members[0], "engine died")
    _wait(lambda: not pool.members[0].reviving)
    assert "did not answer again within 0.3 s" in pool.members[0].reason
    revival.stop()


def _down():
    raise RuntimeError("cannot be reached")


def test_a_late_failure_of_the_engine_that_left_never_drops_the_one_that_came_back():
    fresh = FakeEngine()
    pool, push, engines, revival = _revived(1, lambda i: fresh)
    old = pool.members[0].engine
    pool.drop(pool.members[0], "engine process 9 died", old)
    _wait(lambda: pool.rejoined == 1)
    pool.drop(pool.members[0], "engine process 9 died", old)  # e.g. its last request failing late
    assert pool.members[0].alive and pool.members[0].engine is fresh
    revival.stop()
    pool.shutdown()


def test_an_engine_that_dies_again_soon_after_coming_back_uses_up_its_tries():
    pool, push, engines, revival = _revived(1, lambda i: FakeEngine(), tries=2)
    for n in (1, 2):
        pool.drop(pool.members[0], "engine process 9 died", pool.members[0].engine)
        _wait(lambda n=n: pool.rejoined == n)
    # a third death within STEADY_S
    pool.drop(pool.members[0], "engine process 9 died", pool.members[0].engine)
    _wait(lambda: not pool.members[0].reviving)
    assert not pool.members[0].alive and "not restarted after 2 tries" in pool.members[0].reason
    revival.stop()
