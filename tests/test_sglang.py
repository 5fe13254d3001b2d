"""The SGLang backend on a real `sglang.Engine` (CPU, tiny model): numerics, slots, flips, bad
pushes, pause/flush/load orders, a dead scheduler.

One engine serves the whole module (starting one costs 15-25 s on 2 cores); tests that change
what it serves put back what the next ones expect. Skipped only where sglang is not installed
(`make sglang` installs it; CI always has it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from engine_helpers import hf_logprobs, hf_model, prompts
from safetensors.torch import load_file

from orbit.config import AdapterConfig, RecipeError, TrainerConfig, parse_recipe
from orbit.engine.base import EngineDeadError, EngineError, SamplingParams
from orbit.run.preflight import preflight

pytestmark = pytest.mark.slow  # end-to-end: `make test-fast` leaves it out

needs_sglang = pytest.mark.sglang  # skips without sglang, fails in CI (tests/sglang_gate.py)

# Tolerances, max |engine - reference| logprob on the same tokens, fp32 on both sides.
# Measured on this machine kind (tiny Llama, 2 layers): base ≤ 1e-6, Orbit-trainer LoRA (default
# targets q,k,v,o, r=8, random non-zero A and B) ≤ 1e-5 teacher-forced and on sampled tokens.
BASE_TOL = 1e-4
LORA_TOL = 1e-4
ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LONG = SamplingParams(max_new_tokens=200, temperature=1.0, ignore_eos=True)
SHORT = SamplingParams(max_new_tokens=8, temperature=1.0)


def test_recipe_with_sglang_missing_fails_before_compute(tiny_llama, monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(RecipeError) as err:
        preflight(parse_recipe({"model": str(tiny_llama), "engine": {"backend": "sglang"}}))
    assert "engine.backend" in str(err.value) and "make sglang" in str(err.value)
    assert "install_sglang.sh" in str(err.value)


@needs_sglang
def test_sglang_args_are_checked_against_sglangs_parser_at_load(tiny_llama):
    """`engine.sglang_args`: a real argument becomes its flag; an unknown name, one Orbit sets and a
    value SGLang refuses each fail at load, naming the field."""
    from orbit.engine.sglang.args import server_flags

    def checked(args: dict, backend: str = "sglang"):
        engine = {"backend": backend, "sglang_args": args}
        return preflight(parse_recipe({"model": str(tiny_llama), "engine": engine}))

    ok = checked({"chunked_prefill_size": 512})
    assert server_flags(dict(ok.recipe.engine.sglang_args)) == ["--chunked-prefill-size", "512"]
    for args, says in [
        ({"chunked_prefil_size": 512}, "engine.sglang_args.chunked_prefil_size: not an argument"),
        ({"max_running_requests": 3}, "engine.sglang_args.max_running_requests: Orbit sets"),
        ({"chunked_prefill_size": "x"}, "engine.sglang_args.chunked_prefill_size: SGLang refuses"),
    ]:
        with pytest.raises(RecipeError) as err:
            checked(args)
        assert says in str(err.value), err.value
    with pytest.raises(RecipeError) as err:
        checked({"chunked_prefill_size": 512}, backend="embedded")
    assert "engine.sglang_args: for the SGLang engines Orbit starts" in str(err.value)


# ---- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_llama):
    from orbit.engine.sglang import start_sglang_engine

    eng = start_sglang_engine(
        tiny_llama, max_running=16, max_lora_rank=8, lora_target_modules=ALL_TARGETS
    )
    yield eng
    eng.shutdown()


def _trainer(model: Path, seed: int, **adapter):
    """Orbit's trainer with random non-zero LoRA A and B (its init is the identity)."""
    from orbit.train.trainer import Trainer

    trainer = Trainer(model, AdapterConfig(**adapter), TrainerConfig(), temperature=1.0, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    trainer.model.eval()
    return trainer


@pytest.fixture(scope="module")
def policy_a(tiny_llama):
    return _trainer(tiny_llama, seed=1)  # the recipe's default adapter: LoRA r=8 on q, k, v, o


@pytest.fixture(scope="module")
def policy_b(tiny_llama):
    return _trainer(tiny_llama, seed=2)


def _load(engine, slot: int, policy, version: int) -> None:
    engine.load_adapter(slot, policy.adapter_tensors(), policy.adapter_config(), version)


def _serve_long(engine, policy, version: int, ps: list[list[int]]) -> list:
    """Slot 0 serves `policy`; LONG requests on it are submitted and given time to be running."""
    _load(engine, 0, policy, version)
    engine.activate(0)
    futs = [engine.generate(p, LONG) for p in ps]
    time.sleep(0.3)
    return futs


@torch.no_grad()
def _sampled_ref(model, prompt: list[int], output: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / T) of each output token: what the trainer compares with."""
    ids = torch.tensor([prompt + output])
    logp = torch.log_softmax(model(ids).logits[0].float() / temperature, dim=-1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return logp[pos, torch.tensor(output)].tolist()


GREEDY = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True)


def _greedy(engine, prompt: list[int], slot) -> list:
    """SGLang's greedy tokens and their logprobs (log_softmax(logits)) on a slot (None: the
    base)."""
    c = engine.generate(prompt, GREEDY, slot=slot).result(120)
    return c.output_ids, c.logprobs


def _greedy_vs(engine, model, prompt: list[int], slot) -> float:
    """Max |SGLang - reference| logprob on the tokens SGLang chose greedily."""
    ids, logprobs = _greedy(engine, prompt, slot)
    return _max_diff(logprobs, hf_logprobs(model, prompt, ids))


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a, (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


# ---- numerics ------------------------------------------------------------------------------------


@needs_sglang
def test_base_logprobs_match_transformers(engine, tiny_llama):
    ref_model = hf_model(tiny_llama)
    worst_tf = worst_sampled = 0.0
    for p in prompts(4, seed=3):
        worst_tf = max(worst_tf, _greedy_vs(engine, ref_model, p, slot=None))
    for t in (1.0, 0.7):
        futs = [
            engine.generate(p, SamplingParams(max_new_tokens=24, temperature=t), slot=None)
            for p in prompts(4, seed=4)
        ]
        for f in futs:
            c = f.result(120)
            worst_sampled = max(
                worst_sampled,
                _max_diff(c.logprobs, _sampled_ref(ref_model, c.prompt_ids, c.output_ids, t)),
            )
    print(f"\nbase vs transformers: greedy {worst_tf:.2e}, sampled (T=1, 0.7) {worst_sampled:.2e}")
    assert worst_tf < BASE_TOL and worst_sampled < BASE_TOL


@needs_sglang
def test_trainer_adapter_in_a_slot_matches_peft(engine, policy_a):
    _load(engine, 0, policy_a, version=1)
    peft_model = policy_a.model
    worst_tf = worst_sampled = 0.0
    for p in prompts(4, seed=5):
        worst_tf = max(worst_tf, _greedy_vs(engine, peft_model, p, slot=0))
    with peft_model.disable_adapter():  # the same tokens under the base: what the adapter changes
        p = prompts(1, seed=5)[0]
        ids, with_adapter = _greedy(engine, p, slot=0)
        effect = _max_diff(hf_logprobs(peft_model, p, ids), with_adapter)
    for t in (1.0, 0.7):
        futs = [
            engine.generate(p, SamplingParams(max_new_tokens=24, temperature=t), slot=0)
            for p in prompts(4, 6)
        ]
        for f in futs:
            c = f.result(120)
            assert c.slot == 0 and c.version_start == c.version_end == 1
            worst_sampled = max(
                worst_sampled,
                _max_diff(c.logprobs, _sampled_ref(peft_model, c.prompt_ids, c.output_ids, t)),
            )
    print(
        f"\nLoRA (trainer export, q/k/v/o r=8) vs peft: greedy {worst_tf:.2e}, sampled "
        f"{worst_sampled:.2e} (adapter effect {effect:.2f})"
    )
    assert effect > 0.1, "the adapter must change the logprobs, else the comparison proves nothing"
    assert worst_tf < LORA_TOL and worst_sampled < LORA_TOL


# ---- slots: the flip, overwriting a serving slot -------------------------------------------------


@needs_sglang
@pytest.mark.timeout(180)
def test_flip_in_flight_finish_on_old_slot_new_start_on_new(engine, policy_a, policy_b):
    old = _serve_long(engine, policy_a, 1, prompts(4, seed=7))
    _load(engine, 1, policy_b, version=2)  # the inactive slot, while slot 0 serves
    running = sum(not f.done() for f in old)
    # the double-buffer flip on SGLang (no flush: see push/phases.py)
    engine.pause_generation("in_place")
    engine.activate(1)
    engine.continue_generation()
    new = [engine.generate(p, SHORT) for p in prompts(4, seed=8)]
    olds = [f.result(120) for f in old]
    news = [f.result(120) for f in new]
    assert running > 0, "nothing was in flight at the flip"
    for c in olds:
        assert (c.slot, c.version_start, c.version_end, c.finish_reason) == (0, 1, 1, "length")
        assert len(c.output_ids) == 200
    for c in news:
        assert (c.slot, c.version_start, c.version_end) == (1, 2, 2)
    # and the numbers say the same: old requests ran on A to the end, new ones on B
    assert (
        _max_diff(
            olds[0].logprobs,
            _sampled_ref(policy_a.model, olds[0].prompt_ids, olds[0].output_ids, 1.0),
        )
        < LORA_TOL
    )
    assert (
        _max_diff(
            news[0].logprobs,
            _sampled_ref(policy_b.model, news[0].prompt_ids, news[0].output_ids, 1.0),
        )
        < LORA_TOL
    )


@needs_sglang
@pytest.mark.timeout(180)
def test_overwriting_the_serving_slot_lets_its_requests_finish_first(engine, policy_a, policy_b):
    """The adapter push on SGLang: load slot 0 while it serves (no pause)."""
    running = _serve_long(engine, policy_a, 3, prompts(3, seed=9))
    loader = threading.Thread(target=_load, args=(engine, 0, policy_b, 4))
    loader.start()
    time.sleep(0.05)
    # submitted while slot 0 is being rewritten
    held = engine.generate(prompts(1, seed=10)[0], SHORT)
    loader.join(120)
    assert not loader.is_alive()
    assert all(f.done() for f in running), (
        "load_adapter returned before the slot's requests finished"
    )
    for c in (f.result() for f in running):
        assert (c.version_start, c.version_end, len(c.output_ids)) == (3, 3, 200)
    c = held.result(120)
    assert (c.slot, c.version_start, c.version_end) == (0, 4, 4)
    assert (
        _max_diff(c.logprobs, _sampled_ref(policy_b.model, c.prompt_ids, c.output_ids, 1.0))
        < LORA_TOL
    )


# ---- bad pushes ----------------------------------------------------------------------------------


@needs_sglang
@pytest.mark.timeout(180)
def test_bad_adapter_push_is_rejected_and_the_slot_keeps_serving(engine, policy_a, monkeypatch):
    _load(engine, 0, policy_a, version=5)
    engine.activate(0)
    probe = prompts(1, seed=11)[0]
    before = _greedy(engine, probe, slot=0)
    good, config = policy_a.adapter_tensors(), policy_a.adapter_config()
    name = next(k for k in good if k.endswith("q_proj.lora_A.weight"))

    def bad(**change):
        return {**good, **change}

    nan = good[name].clone()
    nan[0, 0] = float("nan")
    inf = good[name].clone()
    inf[1, 1] = float("inf")
    cases = {
        "shape": (bad(**{name: good[name][:, :-1]}), config),
        "dtype": (bad(**{name: good[name].to(torch.int32)}), config),
        "nan": (bad(**{name: nan}), config),
        "inf": (bad(**{name: inf}), config),
        "unknown name": (bad(**{name.replace("q_proj", "x_proj"): good[name]}), config),
        "layer out of range": (bad(**{name.replace("layers.0.", "layers.9."): good[name]}), config),
        "rank above max_lora_rank": (
            {
                k: torch.zeros(16, v.shape[1]) if "lora_A" in k else torch.zeros(v.shape[0], 16)
                for k, v in good.items()
            },
            {**config, "r": 16},
        ),
        "OFT": ({}, {**config, "peft_type": "OFT"}),
        "DoRA": (good, {**config, "use_dora": True}),
        "missing tensors": ({k: v for k, v in good.items() if "layers.1." not in k}, config),
    }
    for what, (tensors, cfg) in cases.items():
        with pytest.raises(EngineError):
            engine.load_adapter(0, tensors, cfg, 99)
        assert engine.stats().slot_versions[0] == 5, what
    # a load SGLang itself refuses (after the unload): the previous adapter is put back
    real = engine.transport.load_adapter
    calls = []

    async def refuse_once(name, tensors, cfg, version):
        calls.append(name)
        outcome = await real(name, tensors, cfg, version)
        if len(calls) == 1:  # pretend the new adapter was refused (undo it, report failure)
            await engine.transport.unload_adapter(name)
            outcome = (False, "refused for the test")
        return outcome

    monkeypatch.setattr(engine.transport, "load_adapter", refuse_once)
    with pytest.raises(EngineError, match="keeps serving version 5"):
        _load(engine, 0, policy_a, version=6)
    monkeypatch.undo()
    assert len(calls) == 2 and engine.stats().slot_versions[0] == 5
    after = _greedy(engine, probe, slot=0)
    assert after[0] == before[0] and _max_diff(before[1], after[1]) < 1e-6
    c = engine.generate(probe, SHORT).result(60)
    assert c.slot == 0 and c.version_start == 5


@needs_sglang
def test_bad_weight_push_is_rejected(engine, tiny_llama):
    probe = prompts(1, seed=12)[0]
    before = _greedy(engine, probe, slot=None)
    w = load_file(str(tiny_llama / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    nan = w[name].clone()
    nan[0, 0] = float("nan")
    for tensors in (
        {"model.layers.0.self_attn.x_proj.weight": w[name]},
        {name: w[name][:-1]},
        {name: nan},
        {name: w[name].to(torch.int64)},
        {},
    ):
        with pytest.raises(EngineError):
            engine.update_weights(tensors, 50)
    assert engine.stats().base_version == 0
    after = _greedy(engine, probe, slot=None)
    assert after[0] == before[0] and _max_diff(before[1], after[1]) < 1e-6


# ---- no hang in the orders the modes use ---------------------------------------------------------


@pytest.mark.alone  # a time bound: no other test beside it
@needs_sglang
@pytest.mark.timeout(240)
def test_pause_flush_load_continue_orders_never_hang(engine, tiny_llama, policy_a):
    ref = hf_model(tiny_llama)
    original = load_file(str(tiny_llama / "model.safetensors"))

    # full push (sync, async-full): retract, flush, update_weights, continue; requests on base
    # continue
    futs = [engine.generate(p, LONG, slot=None) for p in prompts(3, seed=13)]
    time.sleep(0.3)
    engine.pause_generation("retract")
    engine.flush_cache()
    engine.update_weights({k: v for k, v in original.items() if "layers.1." in k}, 7)
    engine.continue_generation()
    done = [f.result(120) for f in futs]
    assert all(c.finish_reason == "length" and len(c.output_ids) == 200 for c in done)
    assert any(c.version_end == 7 for c in done) and engine.stats().base_version == 7
    assert _greedy_vs(engine, ref, prompts(1, seed=14)[0], slot=None) < BASE_TOL

    # flush during an in_place pause with requests running: refused (EngineError), never a hang
    futs = _serve_long(engine, policy_a, 8, prompts(3, seed=15))
    engine.pause_generation("in_place")
    with pytest.raises(EngineError, match="retract"):
        engine.flush_cache()
    # replacing a slot that paused requests use would deadlock: refused at once
    t0 = time.time()
    with pytest.raises(EngineError, match="while paused"):
        _load(engine, 0, policy_a, version=9)
    assert time.time() - t0 < 5
    engine.pause_generation("in_place")  # twice: harmless
    engine.continue_generation()
    engine.continue_generation()
    assert all(f.result(120).finish_reason == "length" for f in futs)

    # abort (shutdown, Ctrl-C): requests finish with reason abort and their partial output
    futs = [engine.generate(p, LONG) for p in prompts(3, seed=16)]
    time.sleep(0.3)
    engine.pause_generation("abort")
    engine.flush_cache()
    engine.continue_generation()
    reasons = [f.result(120).finish_reason for f in futs]
    assert "abort" in reasons and set(reasons) <= {"abort", "length"}

    # serial modes: release / resume memory around training, loads with nothing in flight
    engine.release_memory()
    engine.resume_memory()
    _load(engine, 0, policy_a, version=10)
    engine.pause_generation("retract")
    engine.flush_cache()
    engine.continue_generation()
    c = engine.generate(prompts(1, seed=17)[0], SHORT).result(60)
    assert (c.slot, c.version_start) == (0, 10)
    stats = engine.stats()
    assert not stats.paused and stats.running == 0 and stats.paused_s > 0


# ---- issue-tracker traps, checked on the real engine ---------------------------------------------


@pytest.mark.alone  # a time bound: no other test beside it
@needs_sglang
@pytest.mark.timeout(180)
def test_unloading_a_slot_after_its_requests_were_aborted_does_not_hang(engine, policy_a, policy_b):
    """SGLang has leaked adapter references on abort and then hung in unload: rewriting a slot whose
    requests were just aborted must finish, and the slot must then serve the new adapter."""
    futs = _serve_long(engine, policy_a, 20, prompts(4, seed=30))
    engine.pause_generation("abort")
    engine.continue_generation()
    assert {f.result(60).finish_reason for f in futs} <= {"abort", "length"}
    assert any(f.result().finish_reason == "abort" for f in futs)
    t0 = time.time()
    _load(engine, 0, policy_b, version=21)  # unload (waits for the slot's users) + load
    assert time.time() - t0 < 30
    c = engine.generate(prompts(1, seed=31)[0], SHORT).result(60)
    assert (c.slot, c.version_start, c.finish_reason != "abort") == (0, 21, True)


@needs_sglang
@pytest.mark.timeout(180)
def test_a_reused_slot_never_serves_prefix_kv_of_its_previous_adapter(engine, policy_a, policy_b):
    """Same prompt on slot 0 under adapter A (its KV goes into SGLang's radix cache), a flip to slot
    1, slot 0 rewritten with adapter B two versions later: the prompt's logprobs on slot 0 equal a
    fresh computation under B (peft), not anything computed under A."""
    p = prompts(1, seed=32, low=40, high=41)[0]  # a long prompt: a prefix-cache hit is most of it
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    _load(engine, 0, policy_a, version=30)
    engine.activate(0)
    under_a = engine.generate(p, greedy).result(60)
    again_a = engine.generate(p, greedy).result(60)  # the radix cache now holds p's KV under A
    assert again_a.output_ids == under_a.output_ids
    _load(engine, 1, policy_a, version=31)
    engine.activate(1)
    _load(engine, 0, policy_b, version=32)  # slot 0 reused, two versions later
    engine.activate(0)
    under_b = engine.generate(p, greedy).result(60)
    fresh = hf_logprobs(policy_b.model, p, under_b.output_ids)
    assert _max_diff(under_b.logprobs, fresh) < LORA_TOL
    assert (
        _max_diff(under_a.logprobs, hf_logprobs(policy_a.model, p, under_a.output_ids)) < LORA_TOL
    )
    # A and B differ
    assert _max_diff(hf_logprobs(policy_a.model, p, under_b.output_ids), fresh) > 0.1


# ---- every request gets an answer ----------------------------------------------------------------


@needs_sglang
@pytest.mark.timeout(120)
def test_a_reply_that_cannot_be_read_fails_the_request_not_hangs(engine, monkeypatch):
    """Parsing SGLang's reply happens after the request left SGLang: a reply without meta_info, or
    with a finish reason Orbit does not know, must fail the future, never leave it unset."""

    async def no_meta(body):
        return {"output_ids": [5, 6]}

    monkeypatch.setattr(engine.transport, "generate", no_meta)
    fut = engine.generate(prompts(1, seed=40)[0], SHORT, slot=None)
    with pytest.raises(EngineError, match="could not be read"):
        fut.result(10)

    async def odd_finish(body):
        return {
            "output_ids": [5],
            "meta_info": {
                "finish_reason": {"type": "preempted"},
                "output_token_logprobs": [[-1.0, 5, None]],
            },
        }

    monkeypatch.setattr(engine.transport, "generate", odd_finish)
    with pytest.raises(EngineError, match="finish reason Orbit does not know.*preempted"):
        engine.generate(prompts(1, seed=41)[0], SHORT, slot=None).result(10)
    monkeypatch.undo()
    assert engine.generate(prompts(1, seed=42)[0], SHORT, slot=None).result(60).finish_reason in (
        "stop",
        "length",
    )
    assert engine.stats().running == 0


@needs_sglang
def test_top_p_top_k_logprobs_are_the_truncated_policy(engine, tiny_llama):
    """With top-k/top-p SGLang reports the sampled token's logprob under the truncated, renormalised
    distribution (its sampling mask), which is what Orbit's trainer scores: transformers' warpers
    agree."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    ref = hf_model(tiny_llama)
    for top_p, top_k in ((0.8, 0), (1.0, 5)):
        sp = SamplingParams(
            max_new_tokens=24, temperature=0.7, top_p=top_p, top_k=top_k, ignore_eos=True
        )
        for f in [engine.generate(p, sp, slot=None) for p in prompts(2, seed=43)]:
            c = f.result(120)
            with torch.no_grad():
                logits = ref(torch.tensor([c.prompt_ids + c.output_ids])).logits[
                    0, len(c.prompt_ids) - 1 : -1
                ]
            scores = TemperatureLogitsWarper(0.7)(None, logits)
            scores = (
                TopKLogitsWarper(top_k)(None, scores)
                if top_k
                else TopPLogitsWarper(top_p)(None, scores)
            )
            want = (
                torch.log_softmax(scores, -1)
                .gather(1, torch.tensor(c.output_ids)[:, None])
                .squeeze(1)
                .tolist()
            )
            assert _max_diff(c.logprobs, want) < BASE_TOL


# ---- a dead scheduler, a clean shutdown ----------------------------------------------------------


@needs_sglang
@pytest.mark.timeout(240)
def test_dead_scheduler_fails_pending_requests_and_shutdown_spares_other_children(tiny_llama):
    from orbit.engine.sglang import start_sglang_engine

    # another child of this process (e.g. an embedded engine)
    bystander = subprocess.Popen(["sleep", "300"])
    try:
        eng = start_sglang_engine(tiny_llama, max_running=8, max_lora_rank=8)
        try:
            futs = [eng.generate(p, LONG, slot=None) for p in prompts(3, seed=18)]
            time.sleep(0.3)
            t0 = time.time()
            os.kill(eng.pid, signal.SIGKILL)
            for f in futs:
                with pytest.raises(EngineDeadError):
                    f.result(30)
            detected = time.time() - t0
            with pytest.raises(EngineDeadError):
                eng.generate([1, 2, 3], SHORT)
            with pytest.raises(EngineDeadError):
                eng.pause_generation("retract")
            print(f"\ndead scheduler detected after {detected:.2f} s")
            assert detected < 5
        finally:
            eng.shutdown()
        assert bystander.poll() is None, "shutdown killed a process that is not SGLang's"
    finally:
        bystander.kill()
        bystander.wait()


@needs_sglang
@pytest.mark.timeout(240)
def test_an_engine_that_fails_to_start_leaves_nothing_that_hangs_later(tiny_llama, tmp_path):
    """A scheduler that dies at start (weights cut short): EngineStartError, no SGLang process
    left, no half-built ZeroMQ context whose finalizer would block the garbage collector and so
    whatever ran next (found on a GPU: `orbit serve` hung after a failed engine start), and no file
    of its left in /dev/shm."""
    import gc
    import shutil

    import psutil

    from orbit.engine.base import EngineStartError
    from orbit.engine.sglang import start_sglang_engine
    from orbit.engine.sglang.process import is_sglang

    bad = tmp_path / "cut"
    shutil.copytree(tiny_llama, bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    files_before = set(Path("/dev/shm").glob("sglang_loads_*"))
    with pytest.raises(EngineStartError, match="failed to start"):
        start_sglang_engine(bad, max_running=8, max_lora_rank=8)
    # a load-snapshot file made since that no process holds: this start's (another test's live
    # engine beside this one holds its own open)
    held = {path for pid in psutil.pids() for path in _open_paths(pid)}
    left_files = [f for f in set(Path("/dev/shm").glob("sglang_loads_*")) - files_before]
    assert not [f for f in left_files if str(f) not in held], "the failed start left its files"
    collector = threading.Thread(target=gc.collect, daemon=True)
    collector.start()
    collector.join(30)
    assert not collector.is_alive(), "the garbage collector hangs on what the failed start left"
    left = [
        p.cmdline()[:3]
        for p in psutil.Process().children(recursive=True)
        if p.pid not in before and is_sglang(p)  # not the fork server a first start starts
    ]
    assert not left, f"processes left by a failed start: {left}"


def _open_paths(pid: int) -> list[str]:
    """What process `pid` has open, by path (none when it is gone or not ours to read)."""
    paths = []
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    for fd in fds:
        try:
            paths.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return paths


# ---- push selection and merged weights (no SGLang needed) ----------------------------------------


def test_merged_weights_of_the_adapted_modules_only(tiny_llama):
    from orbit.train.trainer import Trainer

    trainer = Trainer(
        tiny_llama,
        AdapterConfig(type="oft", oft_block_size=8, target_modules=["q_proj", "o_proj"]),
        TrainerConfig(),
        temperature=1.0,
        seed=0,
    )
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "oft_" in name:
                p.normal_(0, 0.1)
    full, only = trainer.merged_weights(), trainer.merged_weights(only_adapted=True)
    assert sorted(only) == sorted(k for k in full if k.endswith(("q_proj.weight", "o_proj.weight")))
    assert all(torch.equal(only[k], full[k]) for k in only)
    base = load_file(str(tiny_llama / "model.safetensors"))
    assert all(not torch.equal(only[k], base[k]) for k in only)


@needs_sglang
def test_qwen3_as_it_is_base_and_lora_slot_match_transformers_and_peft(tiny_qwen3):
    """SGLang runs Qwen3 (per-head q/k RMSNorm) as it is: base and a LoRA slot against
    transformers/peft."""
    from orbit.engine.sglang import start_sglang_engine

    policy = _trainer(tiny_qwen3, seed=3)
    eng = start_sglang_engine(
        tiny_qwen3, max_running=8, max_lora_rank=8, lora_target_modules=ALL_TARGETS
    )
    try:
        _load(eng, 0, policy, version=1)
        ref = hf_model(tiny_qwen3)
        worst_base = worst_slot = 0.0
        for p in prompts(3, seed=8):
            worst_base = max(worst_base, _greedy_vs(eng, ref, p, slot=None))
            worst_slot = max(worst_slot, _greedy_vs(eng, policy.model, p, slot=0))
    finally:
        eng.shutdown()
    print(f"\nqwen3 on SGLang: base {worst_base:.2e}, LoRA slot {worst_slot:.2e}")
    assert worst_base < BASE_TOL and worst_slot < BASE_TOL
