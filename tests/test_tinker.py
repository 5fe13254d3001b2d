"""`orbit serve` answers the real `tinker` SDK 0.38 (make tinker): training clients on one base,
their losses against each formula, samplers that keep their weights, the sampler's logprobs against
the trainer's, checkpoints that continue exactly, and what is refused. The cookbook's runs:
tests/test_cookbook.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from tinker_helpers import adapter, max_diff, sdk, serving

from orbit.serve.keys import LOCAL

pytestmark = pytest.mark.slow


# How far the engine's logprobs of what it sampled may be from the trainer's: the embedded engine is
# the reference; SGLang's own kernels differ in rounding (printed, docs/tinker.md)
AGREEMENT = {"embedded": 1e-4, "sglang": 1e-2, "sglang-server": 1e-2}


@pytest.fixture
def served(tinker_served):
    """The service on each engine (tests/conftest.py): for what the engines do (sampling)."""
    return tinker_served


@pytest.fixture(scope="module")
def trained(tiny_llama, tmp_path_factory):
    """The service on the embedded engine: for what the trainer does, whatever the engine."""
    with serving(tiny_llama, tmp_path_factory.mktemp("serve-trainer")) as (url, service):
        yield url, service, tiny_llama


def test_two_forward_backwards_then_a_step_equal_one_merged_call(trained):
    url, service, model = trained
    seen = sdk(url, model, "accumulate")
    assert max_diff(adapter(service, seen["a"]), adapter(service, seen["b"])) < 1e-6


def test_soft_targets_as_forward_backward_custom_sends_them(trained):
    """[N, K] target_tokens and weights (SDFT's top-k distillation, the decisions recipe's loss):
    forward gives [N, K] logprobs equal to forward's of each column's tokens alone (the model is
    unchanged between them); a step through the SDK's forward_backward_custom, through
    cross_entropy on the [N, K] inputs, and through K one-column datums give one adapter."""
    url, service, model = trained
    seen = sdk(url, model, "soft_targets")
    got = torch.tensor(seen["logprobs"])
    assert got.shape == (len(seen["one"]), 3)
    want = torch.tensor([seen["one"], *seen["three_four"]]).T
    assert float((got - want).abs().max()) <= 1e-6
    print(
        f"\nsoft targets: losses custom {seen['custom_loss']}, [N, K] {seen['soft_loss']}, "
        f"columns {seen['column_loss']}"
    )
    assert abs(seen["soft_loss"] - seen["column_loss"]) <= 1e-5 * abs(seen["column_loss"])
    assert abs(seen["custom_loss"] - seen["soft_loss"]) <= 1e-5 * abs(seen["soft_loss"])
    b, c = adapter(service, seen["b"]), adapter(service, seen["c"])
    assert max_diff(adapter(service, seen["a"]), b) < 1e-6 and max_diff(b, c) < 1e-6


def test_the_cookbooks_weights_download_of_a_checkpoint_and_of_an_export(trained, tmp_path):
    """save_weights_external and get_external_weights_urls, as the cookbook's `weights.download`
    uses them: a training checkpoint exported encrypted to the age key the download made, fetched
    by its signed links and decrypted, equal to the checkpoint byte for byte, the export deleted
    after; a plain export the same. A link tampered with or of a deleted export opens nothing; an
    export is not sampled; a recipient that is not a key is refused by name."""
    url, service, model = trained
    seen = sdk(url, model, "exports", arg=str(tmp_path))
    print("\n" + json.dumps({k: v for k, v in seen.items() if k != "links"}, indent=1)[:1500])
    saved = service.checkpoint(LOCAL, seen["state"]).directory
    adapter = ["adapter_config.json", "adapter_model.safetensors"]
    for got in (tmp_path / "state", tmp_path / "plain"):
        assert set(adapter) <= {p.name for p in got.iterdir()}
    for name in adapter:  # the training checkpoint's adapter, byte for byte
        assert (tmp_path / "state" / name).read_bytes() == (saved / name).read_bytes()
    assert not [p for p in seen["listed"] if "/external_weights/download" in p]  # deleted after
    assert seen["plain"] in seen["listed"]
    assert set(adapter) <= set(seen["links"])
    link = seen["links"]["adapter_config.json"]
    assert httpx.get(link, timeout=30).status_code == 200  # no key: the link is signed
    assert httpx.get(link[:-3] + "abc", timeout=30).status_code == 404
    assert "external weights, for download" in seen["sample_export"]
    assert "age1nope" in seen["bad_key"] and "not an age recipient" in seen["bad_key"]
    service.delete_checkpoint(LOCAL, seen["plain"])
    assert httpx.get(link, timeout=30).status_code == 404


def test_forward_only_changes_nothing(trained):
    url, service, model = trained
    seen = sdk(url, model, "forward_only")
    assert seen["before"] == seen["after"]
    assert all(p.grad is None for p in service.client(LOCAL, seen["a"]).params)


def test_a_named_sampler_samples_its_weights_after_more_steps(served):
    url, _, model = served
    seen = sdk(url, model, "sampler_keeps_its_weights")
    before, after, new = seen["before"], seen["after"], seen["new"]
    # greedy: the same tokens, the same logprobs (SGLang rounds a batch's rows a little differently
    # from run to run)
    assert after["tokens"] == before["tokens"]
    same = zip(after["logprobs"], before["logprobs"], strict=True)
    assert max(abs(a - b) for a, b in same) < 1e-5
    moved = [abs(a - b) for a, b in zip(new["logprobs"], before["logprobs"], strict=False)]
    assert new["tokens"] != before["tokens"] or max(moved) > 1e-3  # the newer weights differ


def test_the_sampler_and_the_trainer_agree_on_logprobs(served):
    """The engine's logprobs of the tokens it sampled against forward's of the same tokens, after a
    step (a LoRA on every projection and on the output projection)."""
    url, service, model = served
    pairs = sdk(url, model, "sampler_and_trainer_agree")["pairs"]
    diff = max(abs(a - b) for p in pairs for a, b in zip(p["sampled"], p["trained"], strict=True))
    backend = "embedded" if service.bases[0].limits.max_rank is None else "sglang"
    print(f"\n{backend} engine against the trainer: max |logprob difference| {diff:.2e}")
    assert diff <= AGREEMENT[backend]


def test_each_loss_against_its_formula(trained):
    url, _, model = trained
    seen = sdk(url, model, "losses")
    b, adv, w = seen["behaviour"], seen["advantages"], seen["weights"]

    def lp(name: str) -> list[float]:
        return seen["results"][name]["logprobs"]

    def ratio(name: str) -> list[float]:
        return [math.exp(x - y) for x, y in zip(lp(name), b, strict=True)]

    def clip(x: float, lo: float, hi: float) -> float:
        return min(max(x, lo), hi)

    def gspo(name: str, mask: list[bool], lo: float, hi: float) -> float:
        logs = [x - y for x, y, m in zip(lp(name), b, mask, strict=True) if m]
        s = math.exp(sum(logs) / len(logs))
        return -sum(min(s * a, clip(s, lo, hi) * a) for a in adv)

    def dro(name: str, beta: float) -> float:
        return -sum(
            x * a - 0.5 * beta * (x - y) ** 2 for x, y, a in zip(lp(name), b, adv, strict=True)
        )

    want = {
        "cross_entropy": -sum(x * y for x, y in zip(lp("cross_entropy"), w, strict=True)),
        "importance_sampling": -sum(
            r * a for r, a in zip(ratio("importance_sampling"), adv, strict=True)
        ),
        "ppo": -sum(
            min(r * a, clip(r, 0.8, 1.2) * a) for r, a in zip(ratio("ppo"), adv, strict=True)
        ),
        "cispo": -sum(
            clip(r, 0.0, 4.0) * a * x
            for r, a, x in zip(ratio("cispo"), adv, lp("cispo"), strict=True)
        ),
        # GSPO-token (Tinker's page): every token carries the sequence ratio, the geometric mean of
        # the token ratios over the masked tokens (default: those with an advantage), clipped
        "gspo": gspo("gspo", [a != 0 for a in adv], 1 - 3e-4, 1 + 4e-4),
        "gspo_masked": gspo("gspo_masked", [m != 0 for m in seen["mask"]], 0.5, 1.5),
        # DRO (Tinker's page): -sum(log p A - beta/2 (log p - log q)^2), beta 0.05 unless given
        "dro": dro("dro", 0.05),
        "dro_beta": dro("dro_beta", 0.2),
    }
    for name, value in want.items():
        assert seen["results"][name]["loss"] == pytest.approx(value, rel=1e-5, abs=1e-5), name


def test_stable_reinforce_trains_on_the_recorded_sequences(trained):
    """Sampled with record_stability_info, named by provenance as the cookbook names them:
    stable_reinforce's loss is Orbit's reading of it (losses.py), computed here apart from Orbit's
    code on the sampler's logprobs as recorded (the client's copy, one token off by 0.25, is
    reported in the metrics and not used); a step moves the policy; what does not hold is refused
    by name."""
    url, _, model = trained
    seen = sdk(url, model, "stable_reinforce")

    def want(logprobs: list[list[float]], kl_coeff: float) -> float:
        total = 0.0
        for row, lp in zip(seen["rows"], logprobs, strict=True):
            start = row["prompt"]
            for j, q in enumerate(row["sampler"]):
                x, a = lp[start + j], row["advantages"][start + j]
                r = math.exp(x - q)
                total -= min(r, 2.0) * a * x  # truncated importance sampling, C = 2
                d = q - x
                total += kl_coeff * (math.exp(d) - d - 1.0)  # k3 toward the sampler
        return total

    for name, kl in (("plain", 0.0), ("kl", 0.5)):
        got = seen[name]
        assert got["loss"] == pytest.approx(want(got["logprobs"], kl), rel=1e-5, abs=1e-5), name
        assert got["diff"] == pytest.approx(0.25, abs=1e-6), name
    moved = max(
        abs(x - y)
        for new, old in zip(seen["after"], seen["plain"]["logprobs"], strict=True)
        for x, y in zip(new, old, strict=True)
    )
    assert moved > 1e-4
    assert (
        "no recorded sequence" in seen["unrecorded"]
        and "record_stability_info" in (seen["unrecorded"])
    )
    assert "model_input[4] is" in seen["wrong_token"], seen["wrong_token"]
    assert "on a prompt token" in seen["prompt_advantage"]
    assert "provenance works within one session" in seen["other_session"]
    assert "kl_coeff -1.0; at least 0" in seen["kl_bad"]


def test_sampling_params_and_the_base_model(served):
    """The same seed samples the same; temperature 0 and top_k 1 are greedy; a stop token ends a
    sample and stays in it; the base model samples, and a new client (B = 0) scores it alike; the
    SDK loads the tokenizer offline."""
    url, _, model = served
    seen = sdk(url, model, "sampling")
    first, again = seen["seeded"]
    assert [s["tokens"] for s in first] == [s["tokens"] for s in again]
    greedy = [s["tokens"] for s in seen["greedy"]]
    assert greedy[0] == greedy[1] == [s["tokens"] for s in seen["top_k_1"]][0]
    stopped = seen["stop_token"][0]
    cut = greedy[0].index(greedy[0][2]) + 1  # at the stop token's first place, the token kept
    assert stopped["tokens"] == greedy[0][:cut] and stopped["stop"] == "stop"
    pairs = zip(seen["greedy"][0]["logprobs"], seen["base_scored"], strict=True)
    assert max(abs(a - b) for a, b in pairs) < 1e-2  # greedy logprobs are the model's own scores
    assert seen["tokenizer"]


def test_a_client_with_learning_rate_zero_stays_as_it_was(trained):
    url, service, model = trained
    seen = sdk(url, model, "lr_zero")
    init = service.checkpoint(LOCAL, seen["init"]).directory / "adapter_model.safetensors"
    still = adapter(service, seen["still"])
    assert all(torch.equal(still[k], v) for k, v in load_file(init).items())  # bit for bit
    assert max_diff(adapter(service, seen["moving"]), still) > 0


def test_a_client_made_from_a_saved_state_continues_exactly(trained):
    url, service, model = trained
    seen = sdk(url, model, "state_round_trip")
    assert max_diff(adapter(service, seen["a"]), adapter(service, seen["b"])) < 1e-6
    assert seen["path"] in seen["listed"]
    peft_dir = service.checkpoint(LOCAL, seen["path"]).directory
    from peft import PeftConfig

    assert PeftConfig.from_pretrained(str(peft_dir)).r == 4  # peft's own format


def test_what_is_refused_is_said_and_the_client_goes_on(served):
    url, _, model = served
    seen = sdk(url, model, "refusals")
    assert "not/a/model" in seen["base_model"] and "serves" in seen["base_model"]
    assert "lora_config.rank: 0; from 1 to 1024" in seen["rank"]
    assert "stable_reinforce needs provenance" in seen["loss_fn"]
    assert "has shape [1]; the datum has 7 tokens" in seen["lengths"]
    assert "outside the vocabulary" in seen["vocab"]
    assert "soft targets of [0, 2] columns" in seen["mixed_widths"]
    assert "'target_tokens'] has shape [7, 2]; the datum has 7 tokens" in seen["soft_rl"]
    assert "out of range" in seen["lr"]
    assert "loss:sum" in seen["still_trains"]


def test_a_call_the_sdk_refuses_itself_does_not_hold_the_next(trained):
    """The SDK takes a request number, then refuses the call before sending it (`ttl_seconds` not
    finite), or the server refuses it (a NaN learning rate): the same client's next call answers at
    once, not after a wait for the number that never comes (it waited 60 s and failed before)."""
    url, _, model = trained
    seen = sdk(url, model, "own_refusals")
    assert "ValidationError" in seen["ttl_nan"]["refused"]  # the SDK's own, never sent
    for name, what in seen.items():
        print(f"{name}: {what}")
        assert what["refused"], f"{name}: the SDK sent it and it was accepted"
        assert what["next_s"] < 10, f"after {name} the next call took {what['next_s']:.1f} s"
        assert math.isfinite(what["next_loss"])


def test_a_create_model_field_orbit_cannot_honour_is_refused_by_name(trained):
    """The SDK's own body, with what Orbit would otherwise have to ignore: refused, named."""
    import httpx

    url, _, model = trained
    base = {"session_id": "s", "model_seq_id": 0, "base_model": str(model)}
    bodies = {
        "lora_config.train_embed": {**base, "lora_config": {"rank": 4, "train_embed": True}},
        "optimizer_config.type: 'sgd'": {**base, "optimizer_config": {"type": "sgd"}},
    }
    for expected, body in bodies.items():
        res = httpx.post(f"{url}/api/v1/create_model", json=body, timeout=30)
        assert res.status_code == 400 and expected in res.json()["detail"], res.text


def test_an_inflight_sampler_samples_each_newer_inflight_save(served):
    """Tinker's `kind="inflight"` is the double buffer: a later inflight save updates the weights of
    every inflight sampler made before it (their next request samples the new version, equal to the
    trainer's), snapshots keep theirs, and samples running across the save finish, none aborted."""
    url, service, model = served
    seen = sdk(url, model, "inflight")
    v1, v2 = seen["v1"], seen["v2"]
    bound = AGREEMENT["embedded" if service.bases[0].limits.max_rank is None else "sglang"]
    for v in (v1, v2):
        assert max(abs(a - b) for a, b in zip(v["logprobs"], v["trained"], strict=True)) <= bound
    moved = [abs(a - b) for a, b in zip(v2["logprobs"], v1["logprobs"], strict=False)]
    assert v2["tokens"] != v1["tokens"] or max(moved) > 1e-3  # the first sampler moved on
    assert seen["second"]["tokens"] == v2["tokens"]
    assert seen["snapshot"]["tokens"] == v1["tokens"]  # the snapshot did not
    assert len(seen["across"]) == 16 and min(seen["across"]) >= 1
    assert sum(cache.flips for cache in service.bases[0].sampler.caches) >= 1


def test_an_async_rl_loop_on_inflight_samplers(trained):
    """Our own async loop (tests/tinker/async_rl.py): producers sample from the first inflight
    sampler while the trainer steps and publishes; each step's groups are at most a step stale, and
    the engines flipped to each published version."""
    url, service, model = trained
    spec = {"kind": "inflight", "steps": 4, "groups": 2, "group_size": 4, "off_policy": 1}
    spec.update(max_tokens=8, lr=1e-2, seed=0)
    script = Path(__file__).parent / "tinker" / "async_rl.py"
    seen = sdk(url, model, "async", script=script, arg=json.dumps(spec))
    rows = seen["steps"]
    print("\n" + "\n".join(json.dumps(r) for r in rows))
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert max(s for r in rows for s in r["staleness"]) <= 2
    assert any(s >= 1 for r in rows for s in r["staleness"])  # sampling ran ahead of training
    target = next(t for t in service.sessions.targets() if t.model_id == seen["model_id"])
    assert target.newest().version == 5  # the first save, then one a step
    assert sum(cache.flips for cache in service.bases[0].sampler.caches) >= 1


def test_a_sampling_client_gives_the_prompts_logprobs_equal_to_forwards(served):
    """compute_logprobs (the prompt's logprobs: KL penalties, DPO's reference, distillation's
    teacher) on each engine, against the training client's forward of the same tokens at the same
    weights; prompt_logprobs_last_n scores the last n only; the top 3 at each position hold the
    token's own logprob when it is among them; target_prompt_logprobs and topk_sample_logprobs
    (below)."""
    url, service, model = served
    seen = sdk(url, model, "prompt_logprobs")
    sampled, trained = seen["sampled"], seen["trained"]
    assert sampled[0] is None and len(sampled) == len(trained) + 1
    diff = max(abs(a - b) for a, b in zip(sampled[1:], trained, strict=True))
    backend = "embedded" if service.bases[0].limits.max_rank is None else "sglang"
    print(f"\n{backend}: compute_logprobs against forward, max |difference| {diff:.2e}")
    assert diff <= AGREEMENT[backend]
    assert seen["last_3"][:-3] == [None] * (len(sampled) - 3)
    assert max(abs(a - b) for a, b in zip(seen["last_3"][-3:], sampled[-3:], strict=True)) <= 1e-5
    top = seen["top"]
    assert top[0] is None and all(len(row) == 3 for row in top[1:])
    for i, row in enumerate(top[1:], start=1):
        values = [v for _, v in row]
        assert values == sorted(values, reverse=True) and values[-1] <= 0
        assert max(values) >= sampled[i] - AGREEMENT[backend]  # nothing likelier left out
    _targets_and_sampled_top(seen, AGREEMENT[backend], backend)


def _targets_and_sampled_top(seen: dict, tol: float, backend: str) -> None:
    """target_prompt_logprobs (dense, and sparse as the cookbook's decisions recipe sends it through
    its own sample_decision) against forward's logprobs of those tokens at the same weights, 0.0
    where nothing was asked; topk_sample_logprobs against the top k the same sampler gives for
    those positions scored as a prompt."""
    targets, (three, four) = seen["targets"], seen["trained_3_4"]
    assert seen["targets_prompt_logprobs"] is None  # not asked for
    assert _largest([row[0] for row in targets], seen["trained"]) <= tol
    for i, row in enumerate(targets):
        if i % 2 or i == 4:
            assert _largest(row[1:], [three[i], four[i]]) <= tol
        else:
            assert row[1:] == [0.0, 0.0]
    want = torch.softmax(torch.tensor([three[4], four[4]]), dim=0).tolist()
    assert _largest(list(seen["decision"].values()), want) <= tol, seen["decision"]
    diff = 0.0
    for one, continued in zip(seen["sample_top"], seen["continued_top"], strict=True):
        assert len(one["top"]) == len(one["tokens"]) == 5
        for j, row in enumerate(one["top"]):
            ref = continued[4 + j]
            assert len(row) == 3 and row[0][0] == ref[0][0]
            diff = max(diff, _largest([v for _, v in row], [v for _, v in ref]))
            if one["tokens"][j] in dict(row):
                assert abs(dict(row)[one["tokens"][j]] - one["logprobs"][j]) <= tol
    print(f"\n{backend}: the sampled tokens' top 3 against the prompt's: max |diff| {diff:.2e}")
    assert diff <= tol


def _largest(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)
