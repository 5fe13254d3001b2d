"""Protocol behaviour of the embedded engine: prefix cache, pause modes, slot rules, bad input,
and the real path (client + engine process): double-buffer flip, errors across the process,
death."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from engine_helpers import engine_core, max_diff, peft_adapter, prompts, score

from orbit.engine.base import ACTIVE, EngineDeadError, EngineError, SamplingParams
from orbit.engine.embedded import EngineCore, start_embedded_engine

GREEDY = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _run(core: EngineCore, jobs: list[tuple[list[int], SamplingParams, object]]) -> list:
    rids = [core.submit(p, sp, slot) for p, sp, slot in jobs]
    done = dict(core.run_until_idle())
    return [done[r] for r in rids]


def _steps(core: EngineCore, n: int) -> None:
    for _ in range(n):
        core.step()


def _greedy_reference_and_started(model: Path, ps: list[list[int]], steps: int, **core_kw) -> tuple:
    """Greedy reference completions of `ps` run undisturbed, and a fresh core with the same requests
    submitted and stepped `steps` times: the starting point for disturbing a run midway."""
    ref = _run(engine_core(model), [(p, GREEDY, None) for p in ps])
    core = engine_core(model, **core_kw)
    rids = [core.submit(p, GREEDY, None) for p in ps]
    _steps(core, steps)
    return ref, core, rids


# ---- prefix cache --------------------------------------------------------------------------------


def test_group_shares_prompt_prefill_and_flush_drops_it(tiny_llama):
    p = prompts(1, seed=30, low=10, high=12)[0]
    group = [
        SamplingParams(max_new_tokens=12, temperature=1.0, seed=s, ignore_eos=True)
        for s in range(4)
    ]
    # each computes its own prefill
    alone = [_run(engine_core(tiny_llama), [(p, sp, None)])[0] for sp in group]

    core = engine_core(tiny_llama, prefix_cache_size=2)
    together = _run(core, [(p, sp, None) for sp in group])
    st = core.stats()
    assert (st.prefill_tokens, st.prefix_cache_hits, st.prefix_cache_entries) == (len(p), 3, 1)
    for a, t in zip(alone, together, strict=True):  # the shared KV is the KV each would compute
        assert t.output_ids == a.output_ids
        assert max_diff(t.logprobs, a.logprobs) <= 1e-5

    _run(core, [(p, group[0], None)])  # a later identical prompt hits the cache
    assert core.stats().prefill_tokens == len(p) and core.stats().prefix_cache_hits == 4
    core.flush_cache()
    assert core.stats().prefix_cache_entries == 0
    _run(core, [(p, group[0], None)])  # after a flush the prompt is computed again
    assert core.stats().prefill_tokens == 2 * len(p)

    _, tensors, config = peft_adapter(tiny_llama, "lora", seed=1)
    core.load_adapter(0, tensors, config, version=1)
    _run(core, [(p, group[0], 0)])  # same prompt on a slot: its own key, no reuse of base KV
    assert core.stats().prefill_tokens == 3 * len(p)
    _run(core, [(q, group[0], None) for q in prompts(3, seed=31)])
    assert core.stats().prefix_cache_entries == 2  # LRU bound


# ---- pause modes ---------------------------------------------------------------------------------


def test_a_steps_prefill_is_capped_by_max_prefill_tokens(tiny_llama):
    """A step admits whole prompts up to max_prefill_tokens (at least one), however long the step
    then takes: the pool tells a long step from a hang by the engine's heartbeat
    (tests/test_liveness.py)."""
    sp = SamplingParams(max_new_tokens=4, temperature=1.0, ignore_eos=True)
    core = engine_core(tiny_llama, max_running=32)
    for p in prompts(32, seed=5, low=30, high=31):  # 30 tokens each: 960 in all
        core.submit(p, sp, slot=None)
    core.step()
    assert len(core.scheduler.running) == 32  # all at once, under the default 4096
    core = engine_core(tiny_llama, max_running=32, max_prefill_tokens=60)
    for p in prompts(4, seed=6, low=30, high=31):
        core.submit(p, sp, slot=None)
    core.step()
    assert len(core.scheduler.running) == 2  # the option caps it
    _steps(core, 40)
    assert not core.has_work()


def test_pause_in_place_resumes_without_recompute(tiny_llama):
    ps, late = prompts(3, seed=40), prompts(1, seed=41)[0]
    ref, core, rids = _greedy_reference_and_started(tiny_llama, ps, 5)
    before = core.stats()
    core.pause_generation("in_place")
    late_rid = core.submit(late, GREEDY, None)  # submitted while paused: waits
    _steps(core, 3)
    st = core.stats()
    assert st.paused and st.running == 3 and st.waiting == 1
    assert st.tokens_generated == before.tokens_generated  # nothing moved while paused
    core.continue_generation()
    done = dict(core.run_until_idle())
    for rid, r in zip(rids, ref, strict=True):
        assert done[rid].output_ids == r.output_ids and done[rid].finish_reason == "length"
    assert late_rid in done
    st = core.stats()
    # only the late prompt was prefilled
    assert st.prefill_tokens == before.prefill_tokens + len(late)
    assert st.retracted == 0 and st.paused_s > 0 and not st.paused


def test_pause_retract_recomputes_and_keeps_logprobs(tiny_llama):
    ps = prompts(3, seed=42)
    ref, core, rids = _greedy_reference_and_started(tiny_llama, ps, 5)
    before = core.stats()
    core.pause_generation("retract")
    st = core.stats()
    assert st.running == 0 and st.waiting == 3 and st.retracted == 3
    core.continue_generation()
    done = dict(core.run_until_idle())
    for rid, r in zip(rids, ref, strict=True):
        assert done[rid].output_ids == r.output_ids
        assert max_diff(done[rid].logprobs, r.logprobs) <= 1e-5
    # each was re-prefilled with its prompt plus everything generated before the pause
    recomputed = sum(len(p) for p in ps) + before.tokens_generated
    assert core.stats().prefill_tokens == before.prefill_tokens + recomputed


def test_pause_abort_finishes_running_and_waiting(tiny_llama):
    ps = prompts(3, seed=43)
    # the third waits
    ref, core, rids = _greedy_reference_and_started(tiny_llama, ps, 4, max_running=2)
    core.pause_generation("abort")
    done = dict(core.pop_finished())
    assert sorted(done) == sorted(rids)
    assert all(c.finish_reason == "abort" for c in done.values())
    for rid, r in zip(rids[:2], ref[:2], strict=True):  # partial output, a prefix of the full run
        out = done[rid].output_ids
        assert 0 < len(out) < len(r.output_ids) and out == r.output_ids[: len(out)]
    assert done[rids[2]].output_ids == []
    assert core.stats().aborted == 3
    core.continue_generation()
    assert _run(core, [(ps[0], GREEDY, None)])[0].output_ids == ref[0].output_ids


# ---- slot rules ----------------------------------------------------------------------------------


def test_active_binds_at_submission(tiny_llama):
    core = engine_core(tiny_llama)
    for slot, seed in ((0, 1), (1, 2)):
        _, tensors, config = peft_adapter(tiny_llama, "lora", seed=seed)
        core.load_adapter(slot, tensors, config, version=slot + 1)
    core.activate(0)
    core.pause_generation("in_place")
    rid = core.submit(prompts(1)[0], GREEDY, ACTIVE)
    core.activate(1)  # later activations do not rebind it
    core.continue_generation()
    c = dict(core.run_until_idle())[rid]
    assert (c.slot, c.version_start, c.version_end) == (0, 1, 1)  # slot 0 never changed under it
    core.activate(None)
    c = _run(core, [(prompts(1)[0], GREEDY, ACTIVE)])[0]
    assert (c.slot, c.version_start, c.version_end) == (None, 0, 0)
    with pytest.raises(EngineError, match="slot"):
        engine_core(tiny_llama).submit(prompts(1)[0], GREEDY, 1)  # empty slot
    with pytest.raises(EngineError, match="empty"):
        engine_core(tiny_llama).activate(1)


def test_overwriting_a_busy_slot_aborts_only_its_requests(tiny_llama):
    adapters = [peft_adapter(tiny_llama, "lora", seed=s)[1:] for s in (51, 52, 53)]
    core = engine_core(tiny_llama)
    core.load_adapter(0, *adapters[0], version=1)
    core.load_adapter(1, *adapters[1], version=2)
    ps = prompts(2, seed=50)
    jobs = [(p, GREEDY, slot) for slot in (0, 1, None) for p in ps]
    ref = [_run(core, [job])[0] for job in jobs]
    rids = [core.submit(*job) for job in jobs]
    _steps(core, 3)
    # generation is running: slot 0's requests go first
    core.load_adapter(0, *adapters[2], version=3)
    aborted = dict(core.pop_finished())
    assert sorted(aborted) == rids[:2]
    for rid, r in zip(rids[:2], ref[:2], strict=True):
        c = aborted[rid]
        assert c.finish_reason == "abort" and c.version_start == 1
        assert (
            0 < len(c.output_ids) < GREEDY.max_new_tokens
            and c.output_ids == r.output_ids[: len(c.output_ids)]
        )
    assert core.stats().aborted_on_load == 2
    done = dict(core.run_until_idle())
    for rid, r in zip(rids[2:], ref[2:], strict=True):  # slot 1 and base rows: undisturbed
        assert done[rid].output_ids == r.output_ids and done[rid].finish_reason == "length"
    c = _run(core, [(ps[0], GREEDY, 0)])[0]  # new requests see the new contents
    assert c.version_start == 3 and c.output_ids != ref[0].output_ids


def test_overwriting_a_paused_slot_keeps_bindings(tiny_llama):
    old, new = (peft_adapter(tiny_llama, "lora", seed=s)[1:] for s in (61, 62))
    ps = prompts(2, seed=60)
    for mode in ("in_place", "retract"):
        core = engine_core(tiny_llama)
        core.load_adapter(0, *old, version=1)
        core.activate(0)
        ref = _run(core, [(p, GREEDY, 0) for p in ps])
        rids = [core.submit(p, GREEDY, 0) for p in ps]
        _steps(core, 4)
        core.pause_generation(mode)
        kept = {
            s.rid: len(s.output_ids) for s in list(core.scheduler.waiting) + core.scheduler.running
        }
        core.load_adapter(0, *new, version=2)
        core.continue_generation()
        done = dict(core.run_until_idle())
        assert core.stats().aborted == 0
        for rid, p, r in zip(rids, ps, ref, strict=True):
            c, k = done[rid], kept[rid]
            assert c.finish_reason == "length" and (c.slot, c.version_start, c.version_end) == (
                0,
                1,
                2,
            )
            assert (
                c.output_ids[:k] == r.output_ids[:k]
                and max_diff(c.logprobs[:k], r.logprobs[:k]) <= 1e-5
            )
            if mode == "retract":  # recomputed: every later token is exactly the new adapter's
                assert max_diff(c.logprobs[k:], score(core, p, c.output_ids, 0)[k:]) <= 1e-4


def test_release_and_resume_memory(tiny_llama):
    ps = prompts(3, seed=70)
    ref, core, rids = _greedy_reference_and_started(tiny_llama, ps, 4)
    core.release_memory()
    st = core.stats()
    assert (
        not core.pool.allocated
        and st.running == 0
        and st.waiting == 3
        and st.prefix_cache_entries == 0
    )
    _steps(core, 2)
    assert core.stats().tokens_generated == st.tokens_generated
    core.resume_memory()
    done = dict(core.run_until_idle())
    assert [done[r].output_ids for r in rids] == [r.output_ids for r in ref]


# ---- the real path: client + engine process ------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_llama):
    client = start_embedded_engine(tiny_llama, max_running=8, threads=1)
    yield client
    client.shutdown()


def _wait_until(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.mark.slow
def test_double_buffer_flip_without_stalling(engine, tiny_llama):
    _, first, config = peft_adapter(tiny_llama, "lora", seed=81)
    _, second, _ = peft_adapter(tiny_llama, "lora", seed=82)
    engine.load_adapter(0, first, config, version=1)
    engine.activate(0)
    long = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
    ps = prompts(4, seed=80)
    reference = [f.result() for f in [engine.generate(p, long) for p in ps]]
    paused_s = engine.stats().paused_s

    olds = [engine.generate(p, long, meta={"i": i}) for i, p in enumerate(ps)]
    _wait_until(lambda: engine.stats().running == len(ps))
    engine.load_adapter(1, second, config, version=2)  # the inactive slot, while slot 0 serves
    t_loaded = time.time()
    st = engine.stats()
    assert (st.paused, st.paused_s, st.aborted_on_load, st.slot_versions) == (
        False,
        paused_s,
        0,
        (1, 2),
    )

    # a producer thread keeps submitting on ACTIVE while this thread flips
    produced: list = []
    stop = threading.Event()

    def producer() -> None:
        while not stop.is_set():
            produced.append(
                engine.generate(ps[0], SamplingParams(max_new_tokens=8, temperature=0.0))
            )
            time.sleep(0.002)

    thread = threading.Thread(target=producer)
    thread.start()
    engine.pause_generation("in_place")
    engine.flush_cache()
    engine.activate(1)
    engine.continue_generation()
    news = [engine.generate(p, long) for p in ps]
    stop.set()
    thread.join()

    for fut, ref, i in zip(olds, reference, range(len(ps)), strict=True):
        c = fut.result(timeout=60)
        assert c.meta == {"i": i}
        assert c.output_ids == ref.output_ids and max_diff(c.logprobs, ref.logprobs) <= 1e-5
        # finished on slot 0 after the flip
        assert (c.slot, c.version_start, c.version_end) == (0, 1, 1)
        assert c.t_end > t_loaded  # the load returned while they were still running
    # the same adapter, scored by the engine's code in this process
    in_process = engine_core(tiny_llama)
    in_process.load_adapter(1, second, config, version=2)
    for fut, p in zip(news, ps, strict=True):
        c = fut.result(timeout=60)
        assert (c.slot, c.version_start, c.version_end) == (1, 2, 2)
        assert max_diff(c.logprobs, score(in_process, p, c.output_ids, 1)) <= 1e-4
    for fut in produced:
        c = fut.result(timeout=60)
        assert (c.slot, c.version_start) in ((0, 1), (1, 2)) and c.finish_reason != "abort"
    assert engine.stats().aborted == 0


@pytest.mark.slow
def test_bad_inputs_are_refused_and_the_engine_keeps_serving(engine, tiny_llama):
    _, good, config = peft_adapter(tiny_llama, "lora", seed=91)
    engine.load_adapter(1, good, config, version=10)
    p = prompts(1, seed=90)[0]

    def probe(slot):  # greedy logprobs of a fixed prompt: what the slot (or the base) holds
        return (
            engine.generate(p, SamplingParams(max_new_tokens=6, temperature=0.0), slot=slot)
            .result(30)
            .logprobs
        )

    slot_before, base_before = probe(1), probe(None)
    a_name = next(n for n in good if "lora_A" in n)
    nan = good[a_name].clone()
    nan[0, 0] = float("nan")
    inf = good[a_name].clone()
    inf[1, 1] = float("inf")
    missing = dict(good)
    del missing[a_name.replace("lora_A", "lora_B")]
    bad_adapters = [
        ({**good, a_name: torch.zeros(5, 64)}, config, 1, "shape"),
        ({**good, a_name: good[a_name].to(torch.int64)}, config, 1, "dtype"),
        ({**good, a_name: nan}, config, 1, "NaN"),
        ({**good, a_name: inf}, config, 1, "NaN/Inf"),
        (
            {**good, a_name.replace("lora_A", "lora_C"): good[a_name]},
            config,
            1,
            "unknown adapter tensor name",
        ),
        (
            {**good, a_name.replace("layers.0", "layers.9"): good[a_name]},
            config,
            1,
            "unknown adapter tensor name",
        ),
        (missing, config, 1, "lacks lora_B"),
        (good, config, 2, "slot must be one of 0..1"),
        (good, {**config, "peft_type": "IA3"}, 1, "unsupported peft_type"),
        (good, {**config, "use_dora": True}, 1, "use_dora"),
    ]
    for tensors, cfg, slot, message in bad_adapters:
        with pytest.raises(EngineError, match=message):
            engine.load_adapter(slot, tensors, cfg, 11)
        assert probe(1) == slot_before  # the slot kept its previous contents
    assert engine.stats().slot_versions[1] == 10

    weights = {"model.layers.0.mlp.up_proj.weight": torch.zeros(160, 64)}
    for tensors, message in [
        ({"model.layers.0.mlp.up_proj.wieght": torch.zeros(160, 64)}, "unknown parameter"),
        ({"model.layers.0.mlp.up_proj.weight": torch.zeros(64, 160)}, "shape"),
        ({**weights, "model.norm.weight": torch.full((64,), float("nan"))}, "NaN"),
    ]:
        with pytest.raises(EngineError, match=message):
            engine.update_weights(tensors, 99)
    assert probe(None) == base_before and engine.stats().base_version == 0

    for prompt, sp, message in [
        ([], GREEDY, "empty"),
        ([5] * 600, GREEDY, "context"),
        (p, SamplingParams(temperature=-1.0), "temperature"),
        (p, SamplingParams(top_p=0.0), "top_p"),
        (p, SamplingParams(top_k=-1), "top_k"),
        (p, SamplingParams(max_new_tokens=0), "max_new_tokens"),
    ]:
        with pytest.raises(EngineError, match=message):
            engine.generate(prompt, sp)
    with pytest.raises(EngineError, match="not an id"):
        engine.generate([5, 999999], GREEDY).result(timeout=30)
    with pytest.raises(EngineError, match="pause mode"):
        engine.pause_generation("sideways")  # type: ignore[arg-type]
    with pytest.raises(EngineError, match="slot"):
        engine.activate(3)

    # still serving, with the same weights
    assert engine.generate(p, GREEDY, slot=1).result(timeout=30).finish_reason == "length"
    assert probe(1) == slot_before and probe(None) == base_before


@pytest.mark.slow
def test_pause_abort_through_the_process(engine):
    ps = prompts(3, seed=95)
    futs = [
        engine.generate(
            p, SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True), slot=None
        )
        for p in ps
    ]
    _wait_until(lambda: engine.stats().running == 3)
    engine.pause_generation("abort")
    assert all(f.done() for f in futs)  # resolved before the control call returned
    assert {f.result().finish_reason for f in futs} == {"abort"}
    engine.continue_generation()


@pytest.mark.alone  # a time bound: no other test beside it
@pytest.mark.slow
def test_killed_engine_raises_dead_error_promptly(tiny_llama):
    client = start_embedded_engine(tiny_llama, max_running=4)
    futs = [
        client.generate(p, SamplingParams(max_new_tokens=400, ignore_eos=True)) for p in prompts(4)
    ]
    _wait_until(lambda: client.stats().running == 4)
    os.kill(client.pid, signal.SIGKILL)
    t0 = time.monotonic()
    for fut in futs:
        with pytest.raises(EngineDeadError, match="died"):
            fut.result(timeout=10)
    assert time.monotonic() - t0 < 5
    with pytest.raises(EngineDeadError):
        client.stats()
    with pytest.raises(EngineDeadError):
        client.generate(prompts(1)[0], GREEDY)
    client.shutdown()  # idempotent on a dead engine
