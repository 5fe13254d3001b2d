"""Slow is not hung (docs/design.md §8): an engine in a long prefill answers nothing until the step
ends, yet makes progress, and stays in the pool; a stopped one (SIGSTOP) is named hung within the
bound. The rule on its own (engine/liveness.py), then on both engines with real long prefills."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from orbit.engine.base import EngineDeadError, EngineStats, SamplingParams
from orbit.engine.liveness import Liveness
from orbit.engine.pool import PING_S, EnginePool

# ---- the rule ------------------------------------------------------------------------------------


class Silent:
    """A test double for one piece: an engine whose `stats` waits for `answer`, and whose heartbeat
    is what the test sets."""

    def __init__(self) -> None:
        self.answer = threading.Event()
        self.beat: int | None = 0

    def stats(self) -> EngineStats:
        self.answer.wait(30)
        return EngineStats()

    def heartbeat(self) -> int | None:
        return self.beat


def test_a_silent_engine_whose_heartbeat_moves_is_alive_and_one_still_is_hung():
    engine = Silent()  # its ping never answers here
    live = Liveness(engine, timeout_s=5.0, now=0.0)
    for t in range(1, 21):  # a 20 s step that progresses
        engine.beat = t
        assert live.check(float(t)) is None
    said = [live.check(float(t)) for t in range(21, 26)]  # then it stops
    assert said[:4] == [None] * 4
    assert "neither answered nor made progress for 5.0 s (hung)" in str(said[4])
    engine.answer.set()


def test_an_engine_without_a_heartbeat_lives_by_its_answers():
    engine = Silent()
    engine.beat = None
    engine.answer.set()
    live = Liveness(engine, timeout_s=5.0, now=time.monotonic())
    for _ in range(3):
        live.check(time.monotonic())
        time.sleep(0.05)
    assert live.check(time.monotonic() + 4.0) is None  # it answered just now
    engine.answer.clear()
    live.ping = None
    live.check(time.monotonic())  # a ping that hangs
    assert "(hung)" in str(live.check(time.monotonic() + 6.0))
    engine.answer.set()


def test_a_call_bound_that_runs_out_in_a_progressing_step_is_not_death():
    """A client's own call bound (call_timeout_s) can end the ping with EngineDeadError while the
    step goes on: the heartbeat moved meanwhile, so the pool asks again."""

    class Bounded(Silent):
        def stats(self) -> EngineStats:
            self.beat = (self.beat or 0) + 1  # the loop went on meanwhile
            raise EngineDeadError("engine process 7 did not answer stats within 1 s; it is hung")

    engine = Bounded()
    live = Liveness(engine, timeout_s=5.0, now=0.0)
    live.check(0.0)
    live.ping.exception(5)
    assert live.check(5.0) is None  # it ran 5 s, and the heartbeat moved: asked again
    live.ping.exception(5)
    assert "did not answer stats" in str(live.check(6.0))  # failed at once: the client says dead


def test_a_dead_engine_is_named_by_its_own_words():
    class Dead(Silent):
        def stats(self) -> EngineStats:
            raise EngineDeadError("engine process 7 died (exit code -9)")

    engine = Dead()
    live = Liveness(engine, timeout_s=5.0, now=0.0)
    live.check(0.0)
    live.ping.exception(5)  # answered
    assert live.check(1.0) == "engine process 7 died (exit code -9)"


# ---- on the engines ------------------------------------------------------------------------------

BOUND_S = 0.5  # the pool's bound here: a tenth of the default, below a prefill step's second


def _long_prompts(n: int, length: int, first: int = 0) -> list[list[int]]:
    """n prompts no cache holds a prefix of (each starts with its own token)."""
    return [[first + i + 10] + [(7 * i + j) % 1000 + 10 for j in range(length)] for i in range(n)]


def _dropped_within(pool: EnginePool, seconds: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if not pool.members[0].alive:
            return time.monotonic() - t0
        time.sleep(0.05)
    return None


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_embedded_engine_in_a_long_prefill_is_slow_and_stopped_is_hung(smollm2):
    """SmolLM2 prefills several hundred tokens a second on a core: 3,000 prompt tokens in one step
    take seconds, several times the pool's bound here, and the engine answers no call meanwhile. It
    stays in the pool; stopped in the middle of the next prefill, it leaves within the bound and a
    check."""
    from orbit.engine.embedded import start_embedded_engine

    engine = start_embedded_engine(smollm2, max_running=8, threads=1)
    pool = EnginePool([engine], [8], ping_timeout_s=BOUND_S)
    greedy = SamplingParams(max_new_tokens=2, temperature=0.0)
    answers, asking = [time.monotonic()], threading.Event()

    def ask() -> None:  # when the engine answers, as the pool's ping would see it
        while not asking.wait(0.02):
            engine.stats()
            answers.append(time.monotonic())

    asker = threading.Thread(target=ask, daemon=True)
    try:
        asker.start()
        done = [pool.generate(p, greedy) for p in _long_prompts(6, 500)]
        assert all(len(f.result(180).output_ids) == 2 for f in done)
        asking.set()
        asker.join(60)
        assert pool.members[0].alive, pool.members[0].reason
        silent = max(b - a for a, b in zip(answers, answers[1:], strict=False))
        assert silent > 2 * BOUND_S, f"answered every {silent:.2f} s: no step long enough to tell"

        more = [pool.generate(p, greedy) for p in _long_prompts(4, 500, first=100)]
        time.sleep(0.5)  # in the prefill
        os.kill(engine.pid, signal.SIGSTOP)
        after = _dropped_within(pool, BOUND_S + 2 * PING_S + 2.0)
        assert after is not None, "a stopped engine was not named hung"
        assert "neither answered nor made progress" in pool.members[0].reason
        errors = [f.exception(30) for f in more]
        assert all(isinstance(e, EngineDeadError) for e in errors), errors
    finally:
        try:
            os.kill(engine.pid, signal.SIGCONT)  # whatever happened, it can be stopped
        except ProcessLookupError:
            pass
        pool.shutdown()


@pytest.mark.sglang
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_started_sglang_server_at_work_is_slow_and_stopped_is_hung(tiny_llama, monkeypatch):
    """Its /health held, as a long batch holds it (SGLang answers it only once its scheduler puts
    out a token), the server Orbit started is judged by what its processes spend: through waves of
    long prompts it stays alive well past the bound; stopped (SIGSTOP to its process group), it is
    named hung within the bound and the CPU window."""
    from orbit.engine.sglang import http, working
    from orbit.engine.sglang.process import SGLangOptions
    from orbit.engine.sglang.server import start_server_engine

    monkeypatch.setattr(http, "PROBE_TIMEOUT_S", 1.0)
    watch = working.HealthWatch.__init__

    def held(self, ask, pid, timeout_s):
        async def never():  # /health behind a batch that never ends
            await asyncio.sleep(3600)

        watch(self, never, pid, timeout_s)

    monkeypatch.setattr(working.HealthWatch, "__init__", held)
    opts = SGLangOptions(max_running=8, slots=2, max_lora_rank=8)
    engine = start_server_engine(tiny_llama, opts, timeout_s=60)
    group = engine.transport.server.pid
    try:
        sampling = SamplingParams(max_new_tokens=64, temperature=1.0, ignore_eos=True)
        t0, i = time.monotonic(), 0
        while time.monotonic() - t0 < 6.0:  # long prompts, one wave after another
            i += 1
            wave = [engine.generate(p, sampling) for p in _long_prompts(8, 200, first=8 * i)]
            assert all(len(f.result(60).output_ids) == 64 for f in wave)
        engine.stats()  # alive: /health unanswered for 6 s, 6 times the bound

        os.killpg(group, signal.SIGSTOP)
        t0 = time.monotonic()
        while engine.loop.dead is None and time.monotonic() - t0 < 15:
            time.sleep(0.1)
        said = str(engine.loop.dead)
        assert engine.loop.dead is not None, "a stopped server was not named hung"
        assert time.monotonic() - t0 < working.WORK_WINDOW_S + 3.0, said
        assert "did not answer /health for" in said and "its processes spent" in said, said
        share = int(said.split("spent ")[1].split("%")[0])
        assert share < 10 and said.endswith("of a core (hung)"), said
    finally:
        os.killpg(group, signal.SIGCONT)
        engine.shutdown()
