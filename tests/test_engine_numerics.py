"""The embedded engine computes what transformers (+ peft) computes, row by row, in any company."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from engine_helpers import (
    check_greedy,
    engine_core,
    hf_logprobs,
    hf_model,
    max_diff,
    peft_adapter,
    prompts,
    score,
    score_batch,
)

from orbit.engine.base import EngineError, SamplingParams
from orbit.engine.embedded import EngineCore

TOL = 1e-4
ADAPTERS = {  # name -> (peft kind, config options)
    "lora": ("lora", {}),
    "lora-rslora-qv": (
        "lora",
        {"use_rslora": True, "r": 8, "target_modules": ["q_proj", "v_proj"]},
    ),
    "oft-cayley-neumann": ("oft", {}),
    "oft-exact-cayley": ("oft", {"use_cayley_neumann": False, "oft_block_size": 8}),
    "oft-coft-block-share": ("oft", {"coft": True, "eps": 1e-3, "block_share": True}),
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _continuations(n: int, seed: int) -> list[list[int]]:
    return prompts(n, seed=seed + 100, low=4, high=20)


def test_base_logprobs_match_transformers(tiny_any):
    core, ref = engine_core(tiny_any), hf_model(tiny_any)
    items = list(zip(prompts(4), _continuations(4, 0), strict=True))
    # padded batch of different lengths
    batched = score_batch(core, [(p, c, None) for p, c in items])
    for (p, c), got in zip(items, batched, strict=True):
        want = hf_logprobs(ref, p, c)
        assert max_diff(score(core, p, c, None), want) <= TOL
        assert max_diff(got, want) <= TOL


@pytest.mark.parametrize("adapter", list(ADAPTERS))
def test_adapter_in_slot_matches_peft(tiny_any, adapter):
    kind, options = ADAPTERS[adapter]
    model, tensors, config = peft_adapter(tiny_any, kind, seed=1, **options)
    core = engine_core(tiny_any)
    core.load_adapter(1, tensors, config, version=7)
    base = hf_model(tiny_any)
    for p, c in zip(prompts(3, seed=2), _continuations(3, 2), strict=True):
        want = hf_logprobs(model, p, c)
        assert max_diff(score(core, p, c, 1), want) <= TOL
        # the adapter really moves the logprobs (else the comparison above proves nothing)
        assert max_diff(hf_logprobs(base, p, c), want) > 10 * TOL


@pytest.mark.parametrize("adapter", [None, "lora", "oft-cayley-neumann"])
def test_greedy_generation_is_transformers_greedy(tiny_any, adapter):
    # more prompts than rows: admissions happen mid-decode. peft's OFT recomputes its rotations
    # every step, so the adapter cases generate less.
    n, rows = (6, 3) if adapter is None else (4, 2)
    core = engine_core(tiny_any, max_running=rows)
    slot = None
    model = hf_model(tiny_any)
    if adapter is not None:
        kind, options = ADAPTERS[adapter]
        model, tensors, config = peft_adapter(tiny_any, kind, seed=3, **options)
        core.load_adapter(0, tensors, config, version=1)
        slot = 0
    eos = core.spec.eos_token_ids[0]
    ps = prompts(n, seed=4)
    lengths = [40, 12, 33, 40, 25, 40][:n] if adapter is None else [24, 8, 20, 24]
    rids = [
        core.submit(p, SamplingParams(max_new_tokens=n, temperature=0.0), slot)
        for p, n in zip(ps, lengths, strict=True)
    ]
    done = dict(core.run_until_idle())
    for rid, p, n in zip(rids, ps, lengths, strict=True):
        c = done[rid]
        check_greedy(model, p, c.output_ids, n, eos)
        assert c.finish_reason == ("stop" if c.output_ids[-1] == eos else "length")
        # greedy logprobs are log_softmax at temperature 1
        assert max_diff(c.logprobs, hf_logprobs(model, p, c.output_ids)) <= TOL


@pytest.mark.parametrize("top_p, top_k", [(0.8, 0), (1.0, 5), (1.0, 0)])
def test_sampled_logprobs_are_the_truncated_policy(tiny_llama, top_p, top_k):
    """The reported logprob is the sampled token's under the distribution it was sampled from:
    softmax(logits / T) truncated by transformers' own TopK/TopP warpers and renormalised."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    core, ref = engine_core(tiny_llama), hf_model(tiny_llama)
    p = prompts(1, seed=5)[0]
    sp = SamplingParams(
        max_new_tokens=40, temperature=0.7, top_p=top_p, top_k=top_k, seed=3, ignore_eos=True
    )
    rid = core.submit(p, sp, None)
    c = dict(core.run_until_idle())[rid]
    with torch.no_grad():
        logits = ref(torch.tensor([p + c.output_ids])).logits[0, len(p) - 1 : -1]
    scores = TemperatureLogitsWarper(sp.temperature)(None, logits)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    want = torch.log_softmax(scores, -1).gather(1, torch.tensor(c.output_ids)[:, None]).squeeze(1)
    assert max_diff(c.logprobs, want.tolist()) <= TOL
    untruncated = torch.log_softmax(logits / sp.temperature, -1).gather(
        1, torch.tensor(c.output_ids)[:, None]
    )
    # the truncation really moved them: each kept token gains log(1 / kept mass)
    if top_p < 1 or top_k:
        assert (
            min(a - b for a, b in zip(c.logprobs, untruncated.squeeze(1).tolist(), strict=True))
            > 1e-3
        )


def test_top_k_one_is_greedy(tiny_qwen2):
    core = engine_core(tiny_qwen2)
    p = prompts(1, seed=6)[0]
    greedy = core.submit(
        p, SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True), None
    )
    top1 = core.submit(
        p,
        SamplingParams(max_new_tokens=20, temperature=1.3, top_k=1, seed=1, ignore_eos=True),
        None,
    )
    tiny_p = core.submit(
        p,
        SamplingParams(max_new_tokens=20, temperature=1.3, top_p=1e-6, seed=2, ignore_eos=True),
        None,
    )
    done = dict(core.run_until_idle())
    assert done[top1].output_ids == done[greedy].output_ids == done[tiny_p].output_ids


def _three_slotengine_core(path):
    """Slot 0 LoRA, slot 1 OFT, plus the base: the three kinds of row of a mixed batch."""
    core = engine_core(path, max_running=8)
    _, lora, lora_cfg = peft_adapter(path, "lora", seed=11)
    _, oft, oft_cfg = peft_adapter(path, "oft", seed=12)
    core.load_adapter(0, lora, lora_cfg, version=1)
    core.load_adapter(1, oft, oft_cfg, version=2)
    return core


def test_mixed_batch_rows_match_alone(tiny_any):
    core = _three_slotengine_core(tiny_any)
    ps = prompts(3, seed=7)
    # every other row truncates (top_p 0.95): its logprobs are of the truncated distribution
    jobs = [
        (
            p,
            slot,
            SamplingParams(
                max_new_tokens=16 + 4 * i,
                temperature=1.0,
                top_p=(0.95, 1.0)[i % 2],
                seed=i,
                ignore_eos=True,
            ),
        )
        for i, (p, slot) in enumerate((p, s) for p in ps for s in (0, 1, None))
    ]
    alone = []
    for p, slot, sp in jobs:
        rid = core.submit(p, sp, slot)
        alone.append(dict(core.run_until_idle())[rid])
    rids = [core.submit(p, sp, slot) for p, slot, sp in jobs]  # all nine in one batch
    together = dict(core.run_until_idle())
    for rid, a, (p, slot, sp) in zip(rids, alone, jobs, strict=True):
        t = together[rid]
        assert t.slot == a.slot == slot
        assert t.output_ids == a.output_ids  # per-request seed: same tokens whatever the company
        diffs = [abs(x - y) for x, y in zip(t.logprobs, a.logprobs, strict=True)]
        if sp.top_p == 1.0:
            assert max(diffs) <= 1e-5
        # top-p's kept set can differ by the one token at the 0.95 boundary when the logits move by
        else:
            # ~1e-6 with the batch: that position's kept mass then differs by that token's small
            # probability
            assert sum(d > 1e-5 for d in diffs) <= 1 and max(diffs) < 0.05
        untruncated = score(core, p, t.output_ids, slot)
        if sp.top_p == 1.0:
            assert max_diff(untruncated, t.logprobs) <= TOL
        else:  # renormalised over the kept head: never below the untruncated logprob
            assert all(x >= y - TOL for x, y in zip(t.logprobs, untruncated, strict=True))
    # the three slots really differ on the same prompt
    first = [together[r].logprobs[0] for r in rids[:3]]
    assert len({round(x, 3) for x in first}) == 3
    # and a mixed teacher-forced batch agrees with scoring each row alone
    items = [(p, together[r].output_ids, slot) for r, (p, slot, _) in zip(rids, jobs, strict=True)]
    for got, (p, c, slot) in zip(score_batch(core, items), items, strict=True):
        assert max_diff(got, score(core, p, c, slot)) <= 1e-5


def test_full_weight_push_equals_adapter_slot(tiny_any):
    """update_weights with peft's merged weights serves what the LoRA slot serves."""
    model, tensors, config = peft_adapter(tiny_any, "lora", seed=13)
    core = engine_core(tiny_any)
    core.load_adapter(0, tensors, config, version=1)
    merged = {k: v.detach().clone() for k, v in model.merge_and_unload().state_dict().items()}
    p, c = prompts(1, seed=8)[0], _continuations(1, 8)[0]
    via_slot = score(core, p, c, 0)
    before = score(core, p, c, None)
    core.update_weights(merged, version=5)
    assert core.stats().base_version == 5
    assert max_diff(score(core, p, c, None), via_slot) <= TOL
    assert max_diff(before, via_slot) > 10 * TOL


def test_params_name_every_checkpoint_tensor(tiny_any):
    """params() covers the whole HF state dict (Qwen3's q_norm/k_norm included), shapes equal."""
    params, hf = engine_core(tiny_any).decoder.params(), hf_model(tiny_any).state_dict()
    assert {k: tuple(v.shape) for k, v in params.items()} == {
        k: tuple(v.shape) for k, v in hf.items()
    }


def test_full_weight_push_writes_qk_norms(tiny_qwen3):
    """Qwen3's per-head q/k norm weights are pushable and act as transformers' do."""
    core, ref = engine_core(tiny_qwen3), hf_model(tiny_qwen3)
    gen = torch.Generator().manual_seed(15)
    state = ref.state_dict()
    new = {
        k: v * (1 + 0.3 * torch.randn(v.shape, generator=gen))
        for k, v in state.items()
        if k.endswith(("q_norm.weight", "k_norm.weight"))
    }
    assert len(new) == 2 * core.spec.num_layers
    p, c = prompts(1, seed=12)[0], _continuations(1, 12)[0]
    before = score(core, p, c, None)
    core.update_weights(new, version=2)
    ref.load_state_dict(new, strict=False)
    after = score(core, p, c, None)
    assert max_diff(after, hf_logprobs(ref, p, c)) <= TOL
    assert max_diff(before, after) > 10 * TOL


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    ],
)
def test_rope_scaling_matches_transformers(tiny_llama, tmp_path, rope):
    """Non-default rope types come from transformers' ROPE_INIT_FUNCTIONS (inv_freq and attention
    scaling)."""
    for f in tiny_llama.iterdir():
        shutil.copy(f, tmp_path / f.name)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_theta": 10000.0, **rope}
    (tmp_path / "config.json").write_text(json.dumps(config))
    core, ref = engine_core(tmp_path), hf_model(tmp_path)
    p, c = prompts(1, seed=9, low=40, high=41)[0], _continuations(1, 9)[0]
    assert max_diff(score(core, p, c, None), hf_logprobs(ref, p, c)) <= TOL
    # it mattered
    assert max_diff(score(core, p, c, None), score(engine_core(tiny_llama), p, c, None)) > 10 * TOL


def test_sharded_checkpoint(tiny_qwen2, tmp_path):
    hf_model(tiny_qwen2).save_pretrained(tmp_path, max_shard_size="150KB")
    assert (tmp_path / "model.safetensors.index.json").exists() and not (
        tmp_path / "model.safetensors"
    ).exists()
    p, c = prompts(1, seed=10)[0], _continuations(1, 10)[0]
    assert score(engine_core(tmp_path), p, c, None) == score(engine_core(tiny_qwen2), p, c, None)


def test_adapter_dtypes_are_converted_and_low_precision_runs(tiny_llama):
    model, tensors, config = peft_adapter(tiny_llama, "oft", seed=14)
    p, c = prompts(1, seed=11)[0], _continuations(1, 11)[0]
    want = hf_logprobs(model, p, c)
    core = engine_core(tiny_llama)
    core.load_adapter(0, {k: v.double() for k, v in tensors.items()}, config, version=1)
    assert max_diff(score(core, p, c, 0), want) <= TOL
    for dtype in ("bfloat16", "float16"):  # engine dtype: weights, KV and adapters converted
        low = engine_core(tiny_llama, dtype=dtype)
        low.load_adapter(
            0, {k: v.to(torch.bfloat16) for k, v in tensors.items()}, config, version=1
        )
        assert max_diff(score(low, p, c, 0), want) <= 0.1
        out = _run_one(
            low, p, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True), 0
        )
        assert len(out.output_ids) == 8


def _run_one(core: EngineCore, prompt: list[int], sampling: SamplingParams, slot):
    rid = core.submit(prompt, sampling, slot)
    return dict(core.run_until_idle())[rid]


@pytest.mark.parametrize("adapter", [None, "lora"])
def test_prompt_logprobs_are_transformers_teacher_forced(tiny_llama, adapter):
    """A request asking for its prompt's logprobs (and the top 3 at each position) gets what
    transformers (+ peft) gives for the prompt, even when the same prompt is in the prefix cache
    (the cache keeps the last position only: the prompt is run whole)."""
    core = engine_core(tiny_llama)
    ref, slot = hf_model(tiny_llama), None
    if adapter:
        ref, tensors, config = peft_adapter(tiny_llama, "lora", seed=3)
        core.load_adapter(0, tensors, config, version=1)
        slot = 0
    prompt = prompts(1, seed=5, low=9, high=10)[0]
    core.submit(prompt, SamplingParams(max_new_tokens=2), slot=slot)  # warms the prefix cache
    core.run_until_idle()
    core.submit(prompt, SamplingParams(max_new_tokens=2, prompt_logprobs=3), slot=slot)
    [(_, done)] = core.run_until_idle()
    want = hf_logprobs(ref, prompt[:1], prompt[1:])
    assert done.prompt_logprobs[0] is None and len(done.prompt_logprobs) == len(prompt)
    assert max_diff(done.prompt_logprobs[1:], want) <= TOL
    with torch.no_grad():
        logp = torch.log_softmax(ref(torch.tensor([prompt])).logits[0].float(), dim=-1)
    third = logp[:-1].topk(3, dim=-1).values[:, -1]
    assert done.prompt_top[0] == []
    # each its token's logprob, and none below transformers' third (a tie may swap two: by value)
    for i, row in enumerate(done.prompt_top[1:]):
        assert len(row) == 3 and len({t for t, _ in row}) == 3
        assert max_diff([v for _, v in row], [float(logp[i, t]) for t, _ in row]) <= TOL
        assert min(v for _, v in row) >= float(third[i]) - TOL


def test_target_logprobs_and_the_sampled_tokens_top_k_are_transformers(tiny_llama):
    """prompt_targets: the logprobs of the tokens asked for at each prompt position, at temperature
    1, without the prompt's own logprobs unless asked; output_top: each sampled position's k
    likeliest at the request's temperature, before top-k/top-p (the sampled token's own logprob
    among them when nothing is cut)."""
    core, ref = engine_core(tiny_llama), hf_model(tiny_llama)
    prompt = prompts(1, seed=7, low=6, high=7)[0]
    targets = tuple((t, (t + 3) % 64) if i % 2 else () for i, t in enumerate(prompt[1:]))
    sampling = SamplingParams(max_new_tokens=4, output_top=3, prompt_targets=targets, seed=1)
    core.submit(prompt, sampling, None)
    [(_, done)] = core.run_until_idle()
    assert done.prompt_logprobs is None and len(done.output_top) == len(done.output_ids) == 4
    full = torch.tensor([prompt + done.output_ids[:-1]])
    with torch.no_grad():
        logp = torch.log_softmax(ref(full).logits[0].float(), dim=-1)
    for i, (row, ids) in enumerate(zip(done.prompt_target_logprobs, targets, strict=True)):
        assert len(row) == len(ids)
        if ids:
            assert max_diff(row, [float(logp[i, t]) for t in ids]) <= TOL
    for j, (row, token, lp) in enumerate(
        zip(done.output_top, done.output_ids, done.logprobs, strict=True)
    ):
        at = logp[len(prompt) - 1 + j]
        assert len(row) == 3 and max_diff([v for _, v in row], at.topk(3).values.tolist()) <= TOL
        if token in dict(row):
            assert abs(dict(row)[token] - lp) <= TOL
    with pytest.raises(EngineError, match="prompt_targets has 2 rows"):
        core.submit(prompt, SamplingParams(prompt_targets=((1,), (2,))), None)
    with pytest.raises(EngineError, match="prompt_targets token"):
        core.submit(prompt, SamplingParams(prompt_targets=((10**6,),) * (len(prompt) - 1)), None)
