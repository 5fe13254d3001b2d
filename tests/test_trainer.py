"""The trainer and the adapter helpers on the tiny offline checkpoints."""

from __future__ import annotations

import json
import math
from pathlib import Path
from statistics import fmean

import peft
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from orbit.config import AdapterConfig, TrainerConfig
from orbit.rl import AlgorithmConfig
from orbit.rollout.sample import Sample
from orbit.train import peft_adapter as adapters
from orbit.train.peft_adapter import adapter_tensors
from orbit.train.trainer import Trainer

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = AdapterConfig(type="lora", r=4, alpha=8.0)
OFT = AdapterConfig(type="oft", oft_block_size=8, target_modules=ALL_TARGETS)


def _trainer(
    path: Path,
    adapter: AdapterConfig = LORA,
    temperature: float = 1.0,
    seed: int = 0,
    algorithm: AlgorithmConfig | None = None,
    **cfg,
) -> Trainer:
    return Trainer(
        path, adapter, TrainerConfig(**cfg), temperature=temperature, seed=seed, algorithm=algorithm
    )


def _sample(prompt, output, behaviour=None, advantage=0.0, version=(0, 0), mask=None) -> Sample:
    return Sample(
        prompt_ids=list(prompt),
        output_ids=list(output),
        behaviour_logprobs=list(behaviour) if behaviour is not None else [0.0] * len(output),
        reward=0.0,
        version_start=version[0],
        version_end=version[1],
        loss_mask=list(mask) if mask is not None else [],
        advantage=advantage,
    )


SAMPLES = [  # different prompt and output lengths, so padding and offsets matter
    _sample([1, 40, 41, 42], [50, 51, 52]),
    _sample([1, 60], [70, 71, 72, 73, 74]),
    _sample([1, 80, 81], [90]),
]


def _scored(advantages: list[float]) -> list[Sample]:
    """SAMPLES with fixed engine logprobs and the given advantages (an off-policy batch)."""
    return [
        _sample(s.prompt_ids, s.output_ids, [-4.0] * len(s.output_ids), a)
        for s, a in zip(SAMPLES, advantages, strict=True)
    ]


def _perturb(trainer: Trainer, std: float, seed: int = 1) -> None:
    """Move the adapter away from its identity init so merges and forwards are non-trivial."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.params:
            p.add_(torch.randn(p.shape, generator=gen) * std)


def _plain_logprobs(model, samples: list[Sample], temperature: float) -> list[list[float]]:
    """One unpadded sequence at a time through a plain transformers model."""
    out = []
    with torch.no_grad():
        for s in samples:
            logits = model(torch.tensor([s.prompt_ids + s.output_ids])).logits[0]
            logp = torch.log_softmax(logits / temperature, dim=-1)
            first = len(s.prompt_ids) - 1
            out.append([logp[first + i, tok].item() for i, tok in enumerate(s.output_ids)])
    return out


def _plain_model(path: Path, weights: dict[str, torch.Tensor] | None = None):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if weights is not None:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert not unexpected
        assert set(missing) <= {"lm_head.weight"}  # tied to the embedding in Qwen2
        if missing:
            assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def _on_policy(trainer: Trainer, samples: list[Sample]) -> list[Sample]:
    """The samples as if the engine had generated them with the trainer's current weights."""
    lps = trainer.logprobs(samples)
    v = (trainer.version, trainer.version)
    return [
        _sample(s.prompt_ids, s.output_ids, lp, s.advantage, v, s.loss_mask)
        for s, lp in zip(samples, lps, strict=True)
    ]


# -- logprobs --------------------------------------------------------------------------------


def test_logprobs_match_plain_transformers_base(tiny_any: Path):
    # fresh OFT = identity; 2 micro-batches
    trainer = _trainer(tiny_any, OFT, temperature=0.7, micro_batch_tokens=8)
    expected = _plain_logprobs(_plain_model(tiny_any), SAMPLES, 0.7)
    got = trainer.logprobs(SAMPLES)
    for g, e in zip(got, expected, strict=True):
        assert g == pytest.approx(e, abs=1e-5)


@pytest.mark.parametrize("adapter", [LORA, OFT], ids=["lora", "oft"])
def test_logprobs_match_plain_transformers_with_adapter(tiny_llama: Path, adapter: AdapterConfig):
    trainer = _trainer(tiny_llama, adapter, temperature=0.7)
    _perturb(trainer, 0.05)
    expected = _plain_logprobs(_plain_model(tiny_llama, trainer.merged_weights()), SAMPLES, 0.7)
    base = _plain_logprobs(_plain_model(tiny_llama), SAMPLES, 0.7)
    got = trainer.logprobs(SAMPLES)
    for g, e, b in zip(got, expected, base, strict=True):
        assert g == pytest.approx(e, abs=1e-5)
        # the adapter really changed them
        assert max(abs(x - y) for x, y in zip(g, b, strict=True)) > 1e-3


# -- step ------------------------------------------------------------------------------------


@pytest.mark.parametrize("adapter", [LORA, OFT], ids=["lora", "oft"])
def test_steps_raise_the_rewarded_continuation(tiny_llama: Path, adapter: AdapterConfig):
    trainer = _trainer(tiny_llama, adapter, lr=1e-2)
    good = _sample([1, 40, 41], [100, 101, 102], advantage=1.0)
    bad = _sample([1, 40, 41], [200, 201, 202], advantage=-1.0)
    before = [sum(lp) for lp in trainer.logprobs([good, bad])]
    for _ in range(4):
        trainer.step(_on_policy(trainer, [good, bad]))
    after = [sum(lp) for lp in trainer.logprobs([good, bad])]
    assert after[0] > before[0] + 0.5
    assert after[1] < before[1] - 0.5


def test_version_and_logprob_diff(tiny_llama: Path):
    trainer = _trainer(tiny_llama)
    assert trainer.version == 0
    lps = trainer.logprobs(SAMPLES)
    fresh = _sample(
        SAMPLES[0].prompt_ids,
        SAMPLES[0].output_ids,
        [x + 0.25 for x in lps[0]],
        1.0,
        (0, 0),
        mask=[1, 0, 1],
    )
    # generated across a flip: not exactly the current weights, so it counts as drift
    stale = _sample(
        SAMPLES[1].prompt_ids, SAMPLES[1].output_ids, [x - 0.5 for x in lps[1]], -1.0, (0, 1)
    )
    result = trainer.step([fresh, stale])
    assert trainer.version == result.version == 1
    assert result.logprob_diff == pytest.approx(0.25, abs=1e-5)
    assert result.logprob_diff_tokens == 2  # the loss-masked token is left out
    assert result.policy_drift == pytest.approx(0.5, abs=1e-5)
    assert result.policy_drift_tokens == 5
    assert result.tokens == 7 and result.samples == 2
    assert math.isnan(result.kl)
    # Version 0 samples are stale now. With no sample of the current weights in the batch, the
    # trainer re-scores them under the version-0 adapter it kept: the diff is numerics, not drift.
    result = trainer.step([fresh, stale])
    assert trainer.version == result.version == 2
    assert result.logprob_diff == pytest.approx(0.25, abs=1e-5) and result.logprob_diff_tokens == 2
    assert result.policy_drift_tokens == 7  # both differ from the current weights
    # A sample across a flip (0 -> 1) has no single version to re-score it with.
    result = trainer.step([stale])
    assert math.isnan(result.logprob_diff) and result.logprob_diff_tokens == 0
    # Unless it records which version made each token (a multi-turn episode: a turn per version, a
    # tool result between): each token is re-scored under its own version; those of no known version
    # are left out.
    at0, at3 = lps[1], trainer.logprobs(SAMPLES)[1]  # versions 0 and 3 (now) on a 5-token output
    turns = _sample(
        SAMPLES[1].prompt_ids,
        SAMPLES[1].output_ids,
        [at0[0] + 0.125, at0[1] + 0.125, 0.0, at3[3] + 0.125, at3[4] + 0.125],
        1.0,
        (0, 3),
        mask=[1, 1, 0, 1, 1],
    )
    turns.token_versions = [0, 0, -1, 3, 3]
    result = trainer.step([turns])
    assert result.logprob_diff == pytest.approx(0.125, abs=1e-5) and result.logprob_diff_tokens == 4
    # version 3 is stale now and kept; version 0 is no longer kept (SNAPSHOTS)
    result = trainer.step([turns])
    assert result.logprob_diff == pytest.approx(0.125, abs=1e-5) and result.logprob_diff_tokens == 2


def test_logprob_diff_has_dropout_off_and_sees_every_group(tiny_llama: Path):
    """With adapter dropout, the training forward is noisy: logprob_diff is measured in eval mode
    (engine logprobs equal to the eval-mode ones read 0, not the dropout noise). Re-scored stale
    samples are spread over the step's groups, not the first few samples of the first group."""
    from orbit.train.batch import spread_over_groups
    from orbit.train.trainer import RESCORE_GROUPS, RESCORE_SAMPLES

    trainer = _trainer(
        tiny_llama, adapter=AdapterConfig(type="lora", r=4, alpha=8.0, dropout=0.5), seed=3
    )
    _perturb(trainer, 0.3)
    exact = trainer.logprobs(SAMPLES)  # eval mode: what an engine reports for the same weights
    batch = [
        _sample(s.prompt_ids, s.output_ids, lp, a)
        for s, lp, a in zip(SAMPLES, exact, (1.0, -1.0, 0.5), strict=True)
    ]
    result = trainer.step(batch)
    assert result.logprob_diff == pytest.approx(0.0, abs=1e-5) and result.logprob_diff_tokens > 0
    # spread: 4 groups of 4 samples, all from one stale version -> the first of every group first
    samples = [
        _sample(SAMPLES[0].prompt_ids, SAMPLES[0].output_ids, version=(0, 0)) for _ in range(16)
    ]
    for i, s in enumerate(samples):
        s.group_id = i // 4
    picked = spread_over_groups(samples, 8)
    assert len(picked) == 8 and [s.group_id for s in picked[:4]] == [0, 1, 2, 3]
    # a few groups, counted from the `first`-th (modulo the groups)
    turns = [spread_over_groups(samples, RESCORE_SAMPLES, RESCORE_GROUPS, first=f) for f in (2, 5)]
    assert [[s.group_id for s in p] for p in turns] == [[2, 3, 2, 3], [1, 2, 1, 2]]


def test_rescore_turns_over_the_groups_step_by_step(tiny_llama: Path):
    """Stale steps re-score RESCORE_GROUPS groups each, their place in the batch moving on by as
    many each version: over a few steps every place is measured, not only the batch's first."""
    from orbit.train.trainer import RESCORE_GROUPS

    trainer = _trainer(tiny_llama)
    trainer.step(_scored([1.0, -1.0, 0.5]))  # version 0 -> 1: version 0's adapter is kept
    # 4 groups of 2 samples from version 0, group g's outputs g + 1 tokens long
    batch = [
        _sample([1, 40 + g], list(range(50, 51 + g)), [-4.0] * (g + 1), (-1.0) ** i, (0, 0))
        for g in range(4)
        for i in range(2)
    ]
    for i, s in enumerate(batch):
        s.group_id = i // 2
    # 3 steps: version 0's adapter is kept until version 4 (SNAPSHOTS)
    counts = [trainer.step(batch).logprob_diff_tokens for _ in range(3)]
    # each step: 2 samples of each of 2 groups -> 2 x (lengths of the two groups)
    lengths = [g + 1 for g in range(4)]
    assert counts == [
        2 * sum(lengths[(v * RESCORE_GROUPS + k) % 4] for k in range(RESCORE_GROUPS))
        for v in range(1, 4)
    ]  # versions 1, 2, 3: groups (2, 3), (0, 1), (2, 3)


def test_truncated_sampling_is_scored_truncated(tiny_llama: Path):
    """With top_p/top_k the trainer's logprobs are the truncated, renormalised distribution's."""
    from orbit.rl.truncation import truncated_logprobs

    plain, truncated = (
        _trainer(tiny_llama, temperature=0.7),
        Trainer(tiny_llama, LORA, TrainerConfig(), temperature=0.7, seed=0, top_p=0.8, top_k=5),
    )
    a, b = plain.logprobs(SAMPLES), truncated.logprobs(SAMPLES)
    for s, x, y in zip(SAMPLES, a, b, strict=True):
        ids = torch.tensor([s.prompt_ids + s.output_ids])
        with torch.no_grad():
            logits = plain.model(input_ids=ids).logits[0, len(s.prompt_ids) - 1 : -1].float()
        logp = torch.log_softmax(logits / 0.7, -1)
        assert x == pytest.approx(
            logp.gather(1, torch.tensor(s.output_ids)[:, None]).squeeze(1).tolist(), abs=1e-5
        )
        assert y == pytest.approx(
            truncated_logprobs(logp, torch.tensor(s.output_ids), 0.8, 5).tolist(), abs=1e-5
        )
        assert all(v > u for u, v in zip(x, y, strict=True))  # renormalised: each kept token gains


def test_masked_tokens_do_not_affect_the_update(tiny_llama: Path):
    samples = []
    for garbage in (0.0, -1e9):  # the behaviour logprob of a tool token must not matter
        s = _sample(
            [1, 40], [50, 51, 52, 53], [-5.0, garbage, garbage, -4.0], 1.0, mask=[1, 0, 0, 1]
        )
        samples.append([s, _sample([1, 60], [70, 71], [-5.0, -5.0], -1.0)])
    updated = []
    for batch in samples:
        trainer = _trainer(tiny_llama)
        trainer.step(batch)
        updated.append(trainer.adapter_tensors())
    for name, t in updated[0].items():
        assert torch.equal(t, updated[1][name]), name


def test_micro_batches_give_the_same_update(tiny_llama: Path):
    samples = _scored([1.0, -0.5, 2.0])
    results, tensors = [], []
    # the whole batch at once; one sample per micro-batch (each is 4..7 tokens)
    for micro in (0, 6):
        trainer = _trainer(tiny_llama, micro_batch_tokens=micro)
        _perturb(trainer, 0.05)  # so LoRA A and B both get gradients
        results.append(trainer.step(samples))
        tensors.append(trainer.adapter_tensors())
    assert results[0].loss == pytest.approx(results[1].loss, rel=1e-5)
    assert results[0].grad_norm == pytest.approx(results[1].grad_norm, rel=1e-4)
    for name, t in tensors[0].items():
        torch.testing.assert_close(t, tensors[1][name], rtol=1e-4, atol=1e-6)


def test_micro_batches_hold_whole_prompts_within_the_token_budget():
    """A micro-batch costs its prompts once each plus its outputs, padded; prompts' samples stay
    together where they fit, groups sorted by length."""
    from orbit.train.batch import micro_batches, padded_tokens

    a = [_sample([1, 1], [5] * n) for n in (3, 1, 2)]  # one prompt, three samples
    b = [_sample([2, 2, 2], [6] * 20)]
    c = [_sample([3] * 10, [7] * 4) for _ in range(2)]
    parts = micro_batches(c + b + a, budget=24)
    assert [[len(s.output_ids) for s in part] for part in parts] == [[1, 2, 3], [20], [4, 4]]
    assert [padded_tokens(part) for part in parts] == [2 + 3 * 3, 3 + 20, 10 + 2 * 4]
    assert padded_tokens(a + b) == 2 * 3 + 4 * 20  # two prompts, padded to the longer; four outputs
    assert sorted(id(s) for part in micro_batches(a + b + c, 0) for s in part) == sorted(
        id(s) for s in a + b + c
    )
    assert len(micro_batches(a + b + c, 0)) == 1


def test_a_shared_prompt_runs_once_and_gives_the_whole_sequence_forward(tiny_llama: Path):
    """Samples of one prompt (a GRPO group) continue from its keys and values: the logprobs and the
    gradient are those of running every sequence whole."""
    trainer = _trainer(tiny_llama)
    _perturb(trainer, 0.05)
    group = [
        _sample([1, 40, 41, 42], out, [-3.0] * len(out), adv)
        for out, adv in (([50, 51, 52], 1.0), ([60], -1.0), ([70, 71, 72, 73, 74], 0.5))
    ]
    # each sequence whole through the peft model
    whole = _plain_logprobs(trainer.model.eval(), group, 1.0)
    for x, y in zip(trainer.logprobs(group), whole, strict=True):
        assert x == pytest.approx(y, abs=1e-5)

    def gradient(logprobs_of) -> list[torch.Tensor]:
        trainer.model.zero_grad(set_to_none=True)
        sum(lp.sum() * (i + 1) for i, lp in enumerate(logprobs_of())).backward()
        return [p.grad.clone() for p in trainer.params]

    from orbit.train.batch import collate

    def shared():
        batch = collate(group, trainer.pad_id, trainer.version, trainer.device)
        logp, _ = trainer._logprobs(batch)
        return [logp[i, : len(s.output_ids)] for i, s in enumerate(group)]

    def each_whole():
        out = []
        for s in group:
            logits = trainer.model(torch.tensor([s.prompt_ids + s.output_ids])).logits[0]
            logp = torch.log_softmax(logits, dim=-1)
            first = len(s.prompt_ids) - 1
            out.append(logp[first + torch.arange(len(s.output_ids)), torch.tensor(s.output_ids)])
        return out

    for a, b in zip(gradient(shared), gradient(each_whole), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_length_buckets_split_where_padding_costs_most():
    from orbit.train import batch

    widths = [5, 30, 31, 9, 10, 32, 3, 31]
    two = batch.length_buckets(widths, 2, 16)
    assert [(sorted(m), w) for m, w in two] == [([0, 3, 4, 6], 10), ([1, 2, 5, 7], 32)]
    assert batch.length_buckets(widths, 1, 16) == [([6, 0, 3, 4, 1, 2, 7, 5], 32)]
    # a further pass must save more than it costs: near-equal widths stay in one
    assert len(batch.length_buckets([30, 31, 32, 32], 4, 16)) == 1
    assert batch.length_buckets([7], 4, 16) == [([0], 7)]


def test_passes_of_similar_lengths_give_the_one_pass_result(tiny_llama: Path):
    """Samples of one prompt continuing it in several passes (length buckets) score and train as
    in one padded pass."""
    from orbit.train import batch

    outs = ([50, 51], [60] * 9, [70, 71, 72], [80] * 8, [90])
    group = [_sample([1, 40, 41, 42], o, [-3.0] * len(o), 0.5 - i / 4) for i, o in enumerate(outs)]
    results = []
    for buckets in (1, 4):
        trainer = _trainer(tiny_llama)
        _perturb(trainer, 0.05)
        trainer.buckets, trainer.bucket_cost = buckets, 0  # split wherever padding is saved
        b = batch.collate(group, trainer.pad_id, trainer.version, trainer.device)
        widths = [len(o) - 1 or 1 for o in outs]
        assert len(batch.length_buckets(widths, buckets, 0)) == buckets
        trainer.model.zero_grad(set_to_none=True)
        logp, _ = trainer._logprobs(b)
        (logp * torch.arange(1.0, 1.0 + logp.shape[1])).sum().backward()
        results.append((logp.detach(), [p.grad.clone() for p in trainer.params]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
    for one, several in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(one, several, rtol=1e-4, atol=1e-6)


def test_gradients_are_clipped(tiny_llama: Path):
    trainer = _trainer(tiny_llama, max_grad_norm=0.01)
    _perturb(trainer, 0.05)
    result = trainer.step(_scored([1.0, 1.0, 1.0]))
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in trainer.params])).item()
    assert result.grad_norm > 0.1  # reported before clipping
    assert clipped == pytest.approx(0.01, rel=1e-3)


def test_kl_to_base_model(tiny_llama: Path):
    trainer = _trainer(tiny_llama, algorithm=AlgorithmConfig(kl_coef=0.1), lr=1e-2)
    first = trainer.step(_on_policy(trainer, SAMPLES[:1]))
    assert first.kl == pytest.approx(0.0, abs=1e-7)  # LoRA starts as the identity
    _perturb(trainer, 0.1)
    assert trainer.step(_on_policy(trainer, SAMPLES[:1])).kl > 1e-4


def _groups(advantages: list[float]) -> list[Sample]:
    """_scored, each sample a group of its own (mini-batches cut between groups)."""
    out = _scored(advantages)
    for g, sample in enumerate(out):
        sample.group_id = g
    return out


def test_minibatches_are_optimizer_steps_on_shares_of_the_batch(tiny_llama: Path):
    """algorithm.minibatches: 2 on groups [0, 1] and [2] is the same as two steps on each share
    alone, one version later."""
    batch = _groups([1.0, -1.0, 0.5])
    a = _trainer(tiny_llama, algorithm=AlgorithmConfig(minibatches=2), lr=1e-2)
    b = _trainer(tiny_llama, lr=1e-2)
    result = a.step(batch)
    b.step(batch[:2])
    b.step(batch[2:])
    assert (a.version, result.optimizer_steps, result.tokens) == (1, 2, 9)
    for name, t in a.adapter_tensors().items():
        torch.testing.assert_close(t, b.adapter_tensors()[name], rtol=0, atol=1e-7)


def test_the_proximal_policy_is_the_one_before_the_first_optimizer_step(
    tiny_llama: Path, monkeypatch
):
    """With several optimizer steps per batch (2 epochs of 2 mini-batches), the decoupled loss clips
    against the trainer's logprobs before the first of them, scored once in eval mode: AReaL's
    proximal policy."""
    import orbit.train.trainer as trainer_module

    trainer = _trainer(
        tiny_llama, algorithm=AlgorithmConfig(ratio="decoupled", minibatches=2, epochs=2), lr=1e-1
    )
    _perturb(trainer, 0.05)
    batch = _groups([1.0, -1.0, 0.5])
    before = trainer.logprobs(batch)
    seen = []

    def spy(logp, *args, prox_logp=None, **kw):
        seen.append((logp.detach().clone(), prox_logp.clone()))
        return trainer_module.policy_loss.__wrapped__(logp, *args, prox_logp=prox_logp, **kw)

    spy.__wrapped__ = trainer_module.policy_loss
    monkeypatch.setattr(trainer_module, "policy_loss", spy)
    result = trainer.step(batch)
    assert result.optimizer_steps == 4 and len(seen) == 4
    by_length = {len(lp): lp for lp in before}
    for _, prox in seen:
        for row in range(prox.shape[0]):
            n = int((prox[row] != 0).sum())
            assert prox[row, :n].tolist() == pytest.approx(by_length[n], abs=1e-6)
    # the policy moved; the proximal did not
    assert not torch.allclose(seen[-1][0], seen[-1][1], atol=1e-4)
    assert result.logprob_diff == pytest.approx(
        fmean(abs(lp - (-4.0)) for row in before for lp in row), rel=1e-5
    )


def test_a_failing_optimizer_step_leaves_the_batch_untrained(tiny_llama: Path):
    """A non-finite gradient in the second mini-batch: the first one's update is undone (adapter,
    optimizer and schedule as before the batch), so a checkpoint of this version is what the engine
    served."""
    trainer = _trainer(
        tiny_llama, algorithm=AlgorithmConfig(minibatches=2), lr=1e-2, schedule="linear", steps=5
    )
    trainer.step(_groups([1.0, -1.0, 0.5]))
    adapter, lr = trainer.adapter_tensors(), trainer.scheduler.get_last_lr()
    moments = {k: v["exp_avg"].clone() for k, v in trainer.optimizer.state_dict()["state"].items()}
    bad = _groups([1.0, -1.0, float("nan")])
    with pytest.raises(FloatingPointError):
        trainer.step(bad)
    assert trainer.version == 1 and trainer.scheduler.get_last_lr() == lr
    for name, t in trainer.adapter_tensors().items():
        assert torch.equal(t, adapter[name]), name
    state = trainer.optimizer.state_dict()["state"]
    assert all(
        state[k]["step"].item() == 2 and torch.equal(state[k]["exp_avg"], m)
        for k, m in moments.items()
    )


def test_entropy_is_the_sampling_distributions(tiny_llama: Path):
    """The step's entropy: -sum p log p of softmax(logits / T) at each trained token, as plain
    transformers computes it, averaged over the tokens."""
    trainer = _trainer(tiny_llama, temperature=0.7)
    samples = _scored([1.0, -1.0, 0.5])
    model = _plain_model(tiny_llama)
    entropies = []
    with torch.no_grad():
        for s in samples:
            logits = model(torch.tensor([s.prompt_ids + s.output_ids])).logits[0]
            logp = torch.log_softmax(logits / 0.7, dim=-1)
            first = len(s.prompt_ids) - 1
            entropies += [
                -(logp[first + i].exp() * logp[first + i]).sum().item()
                for i in range(len(s.output_ids))
            ]
    assert trainer.step(samples).entropy == pytest.approx(fmean(entropies), rel=1e-5)


# -- checkpoints -----------------------------------------------------------------------------


def test_save_load_resumes_exactly(tiny_llama: Path, tmp_path: Path):
    """Adapter, optimizer, RNG and the learning-rate schedule (a warm-up, then cosine) continue
    exactly."""
    batch = _scored([1.0, -1.0, 0.5])
    cfg = dict(lr=1e-2, weight_decay=0.01, schedule="cosine", warmup_steps=1, steps=4)
    a = _trainer(tiny_llama, **cfg)
    a.step(batch)
    a.step(batch)
    a.save(tmp_path / "ckpt")
    drawn = torch.rand(4)  # the RNG state travels with the checkpoint

    b = Trainer(tiny_llama, LORA, TrainerConfig(**cfg), temperature=1.0, seed=123)
    b.load(tmp_path / "ckpt")
    assert b.version == a.version == 2
    assert torch.equal(torch.rand(4), drawn)
    for name, t in a.adapter_tensors().items():
        assert torch.equal(t, b.adapter_tensors()[name]), name
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for key, state in sa["state"].items():
        for field, value in state.items():
            assert torch.equal(value, sb["state"][key][field]), (key, field)

    assert b.scheduler.state_dict() == a.scheduler.state_dict()
    for _ in range(2):
        ra, rb = a.step(batch), b.step(batch)  # training continues exactly, on the schedule
        assert ra.lr == rb.lr
        for name, t in a.adapter_tensors().items():
            assert torch.equal(t, b.adapter_tensors()[name]), name
    # the last step: k=3 of 4
    assert ra.lr == pytest.approx(1e-2 * 0.5 * (1 + math.cos(math.pi * 2 / 3)))
    assert json.loads((tmp_path / "ckpt" / "trainer_state.json").read_text())["version"] == 2


def test_learning_rate_schedules():
    from orbit.train.schedule import lr_factor

    assert [lr_factor(k, 1, 10, 0, "constant") for k in (0, 9)] == [1.0, 1.0]
    assert [lr_factor(k, 1, 10, 2, "linear") for k in (0, 1, 2, 9)] == pytest.approx(
        [0.5, 1.0, 1.0, 0.125]
    )
    assert [lr_factor(k, 1, 10, 2, "cosine") for k in (2, 6)] == pytest.approx([1.0, 0.5])
    # two optimizer steps per batch: the warm-up and the decay count batches, at half-batch
    # resolution
    assert [lr_factor(k, 2, 10, 1, "linear") for k in (0, 1, 2, 19)] == pytest.approx(
        [0.5, 1.0, 1.0, 1 / 18]
    )
    # a warm-up longer than the run: never decays
    assert lr_factor(0, 1, 3, 5, "cosine") == pytest.approx(0.2)


def test_saved_adapter_loads_with_peft(tiny_llama: Path, tmp_path: Path):
    trainer = _trainer(tiny_llama, OFT)
    _perturb(trainer, 0.05)
    trainer.save(tmp_path / "ckpt")
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "ckpt").eval()
    ids = torch.tensor([SAMPLES[0].prompt_ids + SAMPLES[0].output_ids])
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(ids).logits, trainer.model.eval()(ids).logits, rtol=0, atol=1e-6
        )
    for name, t in adapter_tensors(loaded).items():
        assert torch.equal(t, trainer.adapter_tensors()[name]), name


def test_load_rejects_another_adapter(tiny_llama: Path, tmp_path: Path):
    _trainer(tiny_llama, OFT).save(tmp_path / "oft")
    with pytest.raises(ValueError, match="does not match"):
        _trainer(tiny_llama, LORA).load(tmp_path / "oft")


# -- adapters --------------------------------------------------------------------------------


@pytest.mark.parametrize("adapter", [LORA, OFT], ids=["lora", "oft"])
def test_merged_weights(tiny_any: Path, adapter: AdapterConfig):
    trainer = _trainer(tiny_any, adapter)
    _perturb(trainer, 0.05)
    before = {n: t.clone() for n, t in trainer.model.state_dict().items()}

    merged = trainer.merged_weights()

    with safe_open(str(tiny_any / "model.safetensors"), "pt") as f:
        assert set(merged) == set(f.keys())
    after = trainer.model.state_dict()
    assert before.keys() == after.keys()
    for name, t in before.items():
        assert torch.equal(t, after[name]), f"merged_weights disturbed {name}"

    ids = torch.tensor([SAMPLES[1].prompt_ids + SAMPLES[1].output_ids])
    with torch.no_grad():
        want = trainer.model.eval()(ids).logits
        got = _plain_model(tiny_any, merged)(ids).logits
        unmerged = _plain_model(tiny_any)(ids).logits
    assert (got - want).abs().max().item() <= 1e-5
    assert (unmerged - want).abs().max().item() > 1e-3  # the test can tell a missing merge


def test_adapter_tensors_and_config(tiny_llama: Path):
    trainer = _trainer(tiny_llama)
    tensors = trainer.adapter_tensors()
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors
    assert len(tensors) == 2 * 4 * 2  # layers x targets x (A, B)
    assert all(t.is_contiguous() and not t.requires_grad for t in tensors.values())
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors[name].zero_()  # a copy: the trainer's weights are untouched
    assert trainer.adapter_tensors()[name].abs().sum() > 0
    config = trainer.adapter_config()
    assert json.loads(json.dumps(config)) == config
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    oft = _trainer(tiny_llama, OFT).adapter_tensors()
    # 64 / 8 blocks
    assert oft["base_model.model.model.layers.0.self_attn.q_proj.oft_R.weight"].shape == (8, 28)


def test_peft_config_fields():
    lora = adapters.peft_config(
        AdapterConfig(type="lora", r=16, alpha=32.0, dropout=0.1, target_modules=["q_proj"])
    )
    assert isinstance(lora, peft.LoraConfig)
    assert (lora.r, lora.lora_alpha, lora.lora_dropout, set(lora.target_modules)) == (
        16,
        32.0,
        0.1,
        {"q_proj"},
    )
    oft = adapters.peft_config(AdapterConfig(type="oft", oft_block_size=16, dropout=0.1))
    assert isinstance(oft, peft.OFTConfig)
    assert (oft.r, oft.oft_block_size, oft.module_dropout) == (0, 16, 0.1)


def test_bad_oft_block_size_is_rejected(tiny_llama: Path):
    # hidden 64 and intermediate 160: 64 divides q_proj's in_features but not down_proj's
    bad = AdapterConfig(type="oft", oft_block_size=64, target_modules=["q_proj", "down_proj"])
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with pytest.raises(
        ValueError, match=r"adapter\.oft_block_size.*allowed values: \[2, 4, 8, 16, 32\]"
    ):
        adapters.peft_config(bad, model)
    with pytest.raises(ValueError, match=r"adapter\.oft_block_size"):
        _trainer(tiny_llama, bad)
    adapters.peft_config(bad.model_copy(update={"oft_block_size": 32}), model)  # 32 divides both
