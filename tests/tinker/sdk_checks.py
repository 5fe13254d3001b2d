"""Run by tests/test_tinker.py in .venv-tinker (make tinker): the real `tinker` SDK 0.38 against an
`orbit serve`. `python sdk_checks.py BASE_URL MODEL CHECK` runs one check and prints one JSON line
of what it saw; the test compares it with the service's own state and with the formulas."""

from __future__ import annotations

import asyncio
import json
import os
import sys

os.environ.setdefault("TINKER_TELEMETRY", "0")

import tinker  # noqa: E402
import torch  # noqa: E402
from tinker import types  # noqa: E402

TOKENS = [1, 5, 9, 13, 17, 21, 25, 29]


def datum(tokens: list[int], **inputs: list[float]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], **inputs},
    )


def ce(tokens: list[int]) -> types.Datum:
    return datum(tokens, weights=[1.0] * (len(tokens) - 1))


def aimed(tokens: list[int], target: int) -> types.Datum:
    """`tokens` in, `target` the target at every position: forward gives its logprob at each."""
    n = len(tokens) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": [target] * n, "weights": [1.0] * n},
    )


def logprobs(out) -> list[list[float]]:
    return [o["logprobs"].tolist() for o in out.loss_fn_outputs]


def client(service: tinker.ServiceClient, model: str, **kw):
    return service.create_lora_training_client(base_model=model, rank=4, **kw).result()


def accumulate(service, model):
    """Two forward_backward calls then a step, beside one merged call then a step (same seed)."""
    a, b = client(service, model, seed=7), client(service, model, seed=7)
    one, two = ce(TOKENS), ce(TOKENS[2:] + [33, 37])
    a.forward_backward([one], "cross_entropy").result()
    a.forward_backward([two], "cross_entropy").result()
    a.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    b.forward_backward([one, two], "cross_entropy").result()
    b.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return {"a": a.model_id, "b": b.model_id}


def soft_targets(service, model):
    """Soft targets ([N, K] target_tokens and weights: a distribution over K tokens a position), as
    the cookbook's SDFT and decisions send them: a forward's [N, K] logprobs; a step through
    forward_backward_custom (the SDK computes the loss client-side and sends its gradient as [N, K]
    weights), one through cross_entropy on the [N, K] inputs, and one through K datums of one
    column each, from one seed."""
    n = len(TOKENS) - 1
    tokens = torch.tensor([[t, 3, 4] for t in TOKENS[1:]])
    dist = torch.tensor([[0.5, 0.3, 0.2]] * n)

    def soft(weights: torch.Tensor) -> types.Datum:
        return types.Datum(
            model_input=types.ModelInput.from_ints(TOKENS[:-1]),
            loss_fn_inputs={
                "target_tokens": types.TensorData.from_torch(tokens),
                "weights": types.TensorData.from_torch(weights),
            },
        )

    def distribution_loss(data, logprobs_list):
        loss = sum(-(dist * lp).sum() for lp in logprobs_list)
        return loss, {"soft_loss": float(loss)}

    a, b, c = (client(service, model, seed=11) for _ in range(3))
    seen = a.forward([soft(torch.zeros(n, 3))], "cross_entropy").result()
    one = logprobs(a.forward([ce(TOKENS)], "cross_entropy").result())[0]
    three_four = [
        logprobs(a.forward([aimed(TOKENS, t)], "cross_entropy").result())[0] for t in (3, 4)
    ]
    custom = a.forward_backward_custom([soft(torch.zeros(n, 3))], distribution_loss).result()
    b_out = b.forward_backward([soft(dist)], "cross_entropy").result()
    columns = [
        types.Datum(
            model_input=types.ModelInput.from_ints(TOKENS[:-1]),
            loss_fn_inputs={"target_tokens": tokens[:, k].tolist(), "weights": dist[:, k].tolist()},
        )
        for k in range(3)
    ]
    c_out = c.forward_backward(columns, "cross_entropy").result()
    for x in (a, b, c):
        x.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return {
        "a": a.model_id,
        "b": b.model_id,
        "c": c.model_id,
        "logprobs": seen.loss_fn_outputs[0]["logprobs"].tolist(),
        "one": one,
        "three_four": three_four,
        "custom_loss": custom.metrics.get("soft_loss"),
        "soft_loss": b_out.metrics["loss:sum"],
        "column_loss": c_out.metrics["loss:sum"],
    }


def exports(service, model, out_dir: str):
    """The cookbook's `weights.download` of a training checkpoint (it exports the checkpoint
    encrypted to an age key it makes, fetches the files by their signed links, decrypts them and
    deletes the export) and of a plain export; what the service refuses of exports."""
    from pathlib import Path

    from tinker_cookbook import weights

    a = client(service, model, seed=53)
    a.forward_backward([ce(TOKENS)], "cross_entropy").result()
    a.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    state = a.save_state("for-download").result().path
    url = os.environ["TINKER_BASE_URL"]
    weights.download(tinker_path=state, output_dir=str(Path(out_dir) / "state"), base_url=url)
    plain = a.save_weights_external("plain").result().path
    weights.download(tinker_path=plain, output_dir=str(Path(out_dir) / "plain"), base_url=url)
    rest = service.create_rest_client()
    links = rest.get_external_weights_urls(plain).result()
    out = {"state": state, "plain": plain, "links": links.urls, "expires": str(links.expires)}
    out["listed"] = [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints]
    for name, call in {
        "sample_export": lambda: (
            service.create_sampling_client(model_path=plain)
            .sample(types.ModelInput.from_ints(TOKENS), 1, types.SamplingParams(max_tokens=1))
            .result()
        ),
        "bad_key": lambda: a.save_weights_external(
            "x", age_encryption_recipients=["age1nope"]
        ).result(),
    }.items():
        try:
            call()
            out[name] = None
        except Exception as err:  # noqa: BLE001 - the refusal is the finding
            out[name] = f"{type(err).__name__}: {err}"[:400]
    return out


def forward_only(service, model):
    a = client(service, model, seed=3)
    before = logprobs(a.forward([ce(TOKENS)], "cross_entropy").result())
    a.optim_step(types.AdamParams(learning_rate=1e-1)).result()  # nothing accumulated: no change
    after = logprobs(a.forward([ce(TOKENS)], "cross_entropy").result())
    return {"a": a.model_id, "before": before, "after": after}


def sampler_keeps_its_weights(service, model):
    a = client(service, model, seed=5)
    a.forward_backward([ce(TOKENS)], "cross_entropy").result()
    a.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = a.save_weights_for_sampler("first").result().path
    first = service.create_sampling_client(model_path=path)
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0)
    prompt = types.ModelInput.from_ints(TOKENS[:4])

    def sample(sampler) -> dict:
        s = sampler.sample(prompt, num_samples=1, sampling_params=greedy).result().sequences[0]
        return {"tokens": s.tokens, "logprobs": s.logprobs}

    seen = sample(first)
    for _ in range(3):
        a.forward_backward([ce(TOKENS)], "cross_entropy").result()
        a.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    return {
        "path": path,
        "before": seen,
        "after": sample(first),
        "new": sample(a.save_weights_and_get_sampling_client()),
    }


def sampler_and_trainer_agree(service, model):
    """Logprobs of the same tokens: the sampler's (engine) against forward's (trainer)."""
    a = client(service, model, seed=9)
    a.forward_backward([ce(TOKENS)], "cross_entropy").result()
    a.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    sampler = a.save_weights_and_get_sampling_client()
    prompt = TOKENS[:4]
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=11)
    seqs = sampler.sample(types.ModelInput.from_ints(prompt), 3, params).result().sequences
    out = []
    for s in seqs:
        full = prompt + s.tokens
        scored = logprobs(a.forward([ce(full)], "cross_entropy").result())[0]
        out.append({"sampled": s.logprobs, "trained": scored[len(prompt) - 1 :]})
    return {"pairs": out}


def losses(service, model):
    """Each loss's loss:sum and logprobs, for the test to check against its formula."""
    a = client(service, model, seed=13)
    n = len(TOKENS) - 1
    behaviour = [-2.0 + 0.1 * i for i in range(n)]
    advantages = [1.5 if i % 2 else -0.5 for i in range(n)]
    weights = [0.0, 1.0, 1.0, 0.5, 1.0, 0.0, 1.0][:n]
    rl = {"logprobs": behaviour, "advantages": advantages}
    mask = [1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0][:n]
    out = {}
    for name, loss_fn, inputs, config in (
        ("cross_entropy", "cross_entropy", {"weights": weights}, None),
        ("importance_sampling", "importance_sampling", rl, None),
        ("ppo", "ppo", rl, None),
        ("cispo", "cispo", rl, None),
        ("gspo", "gspo", rl, None),
        (
            "gspo_masked",
            "gspo",
            {**rl, "sequence_ratio_mask": mask},
            {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5},
        ),
        ("dro", "dro", rl, None),
        ("dro_beta", "dro", rl, {"beta": 0.2}),
    ):
        result = a.forward([datum(TOKENS, **inputs)], loss_fn, config).result()
        out[name] = {"loss": result.metrics["loss:sum"], "logprobs": logprobs(result)[0]}
    return {
        "results": out,
        "behaviour": behaviour,
        "advantages": advantages,
        "weights": weights,
        "mask": mask,
    }


def _provenance(d: types.Datum, prompt: list[int], sampled: int, sid: str) -> types.Datum:
    """As the cookbook's rl_loop names a sampled sequence behind every position."""
    return d.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sid, length=len(prompt)),
            types.SampledProvenanceSpan(sequence_id=sid, length=sampled - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=len(prompt) - 1),
            types.SampledProvenanceSpan(sequence_id=sid, length=sampled),
        ],
    )


def _refused(call) -> str:
    try:
        call()
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"
    return ""


def stable_reinforce(service, model):
    """Sampling with record_stability_info, then stable_reinforce on the recorded sequences: its
    loss and logprobs (for the formula), a step, and what is refused."""
    a = client(service, model, seed=31)
    sampler = a.save_weights_and_get_sampling_client(record_stability_info=True)
    prompt = TOKENS[:4]
    params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=3)
    seqs = sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result().sequences
    data, rows = [], []
    for k, s in enumerate(seqs):
        full, n = prompt + s.tokens, len(s.tokens)
        advantage = 1.0 if k == 0 else -0.5
        row = {
            "sampler": list(s.logprobs),
            "advantages": [0.0] * (len(prompt) - 1) + [advantage] * n,
            "prompt": len(prompt) - 1,
        }
        # the client's logprobs: the sampler's copy, a little off on one token (reported, unused)
        sent = [0.0] * (len(prompt) - 1) + [
            x + (0.25 if j == 0 else 0.0) for j, x in enumerate(s.logprobs)
        ]
        d = datum(full, logprobs=sent, advantages=row["advantages"])
        data.append(_provenance(d, prompt, n, s.sequence_id))
        rows.append(row)
    out = {"rows": rows, "ids": [s.sequence_id for s in seqs]}
    for name, config in (("plain", None), ("kl", {"kl_coeff": 0.5})):
        result = a.forward(data, "stable_reinforce", config).result()
        out[name] = {
            "loss": result.metrics["loss:sum"],
            "logprobs": logprobs(result),
            "diff": result.metrics["sampler_logprob_diff:max"],
        }
    a.forward_backward(data, "stable_reinforce").result()
    a.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    out["after"] = logprobs(a.forward(data, "stable_reinforce").result())
    # refused, each by name: no record (sampled without record_stability_info), a token that is
    # not the recorded one, an advantage on a prompt token, another session's sequence
    plain = a.save_weights_and_get_sampling_client()
    other = plain.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences[0]
    full = prompt + other.tokens
    unrecorded = _provenance(
        datum(full, advantages=[0.0] * 3 + [1.0] * len(other.tokens)),
        prompt,
        len(other.tokens),
        other.sequence_id,
    )
    out["unrecorded"] = _refused(lambda: a.forward([unrecorded], "stable_reinforce").result())
    s = seqs[0]
    wrong = prompt + [(s.tokens[0] + 1) % 100] + s.tokens[1:]
    swapped = _provenance(
        datum(wrong, advantages=rows[0]["advantages"]), prompt, len(s.tokens), s.sequence_id
    )
    out["wrong_token"] = _refused(lambda: a.forward([swapped], "stable_reinforce").result())
    on_prompt = _provenance(
        datum(prompt + s.tokens, advantages=[1.0] * (len(prompt) - 1 + len(s.tokens))),
        prompt,
        len(s.tokens),
        s.sequence_id,
    )
    out["prompt_advantage"] = _refused(lambda: a.forward([on_prompt], "stable_reinforce").result())
    elsewhere = tinker.ServiceClient(base_url=sys.argv[1])
    b = client(elsewhere, model, seed=37)
    out["other_session"] = _refused(lambda: b.forward(data[:1], "stable_reinforce").result())
    out["kl_bad"] = _refused(
        lambda: a.forward(data, "stable_reinforce", {"kl_coeff": -1.0}).result()
    )
    return out


def lr_zero(service, model):
    still, moving = client(service, model, seed=17), client(service, model, seed=19)
    init = still.save_state("init").result().path
    for _ in range(3):
        for c, lr in ((still, 0.0), (moving, 1e-2)):
            c.forward_backward([ce(TOKENS)], "cross_entropy").result()
            c.optim_step(types.AdamParams(learning_rate=lr)).result()
    return {"still": still.model_id, "moving": moving.model_id, "init": init}


def state_round_trip(service, model):
    """save_state, more steps, then a new client from the state: it continues exactly."""
    a = client(service, model, seed=23)
    a.forward_backward([ce(TOKENS)], "cross_entropy").result()
    a.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = a.save_state("mid").result().path
    a.forward_backward([ce(TOKENS)], "cross_entropy").result()
    a.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    b = service.create_training_client_from_state_with_optimizer(path).result()
    b.forward_backward([ce(TOKENS)], "cross_entropy").result()
    b.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    rest = tinker.ServiceClient(base_url=sys.argv[1], api_key="tml-local").create_rest_client()
    runs = rest.list_checkpoints(a.model_id).result()
    return {
        "a": a.model_id,
        "b": b.model_id,
        "path": path,
        "listed": [c.tinker_path for c in runs.checkpoints],
    }


def refusals(service, model):
    """What Orbit refuses, as the SDK surfaces it."""
    out = {}
    try:
        service.create_lora_training_client(base_model="not/a/model", rank=4).result()
    except Exception as err:  # noqa: BLE001
        out["base_model"] = f"{type(err).__name__}: {err}"
    try:
        service.create_lora_training_client(base_model=model, rank=0).result()
    except Exception as err:  # noqa: BLE001
        out["rank"] = f"{type(err).__name__}: {err}"
    a = client(service, model, seed=29)
    try:
        a.forward([datum(TOKENS, weights=[1.0] * (len(TOKENS) - 1))], "stable_reinforce").result()
    except Exception as err:  # noqa: BLE001
        out["loss_fn"] = f"{type(err).__name__}: {err}"
    try:
        a.forward([datum(TOKENS, weights=[1.0])], "cross_entropy").result()
    except Exception as err:  # noqa: BLE001
        out["lengths"] = f"{type(err).__name__}: {err}"
    try:
        a.forward([ce([1, 2, 10**7])], "cross_entropy").result()
    except Exception as err:  # noqa: BLE001
        out["vocab"] = f"{type(err).__name__}: {err}"
    two = types.TensorData.from_torch(torch.tensor([[t, 3] for t in TOKENS[1:]]))
    wide = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={
            "target_tokens": two,
            "weights": types.TensorData.from_torch(torch.ones(len(TOKENS) - 1, 2)),
        },
    )
    try:
        a.forward([wide, ce(TOKENS)], "cross_entropy").result()
    except Exception as err:  # noqa: BLE001
        out["mixed_widths"] = f"{type(err).__name__}: {err}"
    rl = {"logprobs": [0.0] * (len(TOKENS) - 1), "advantages": [1.0] * (len(TOKENS) - 1)}
    try:
        a.forward(
            [
                types.Datum(
                    model_input=wide.model_input, loss_fn_inputs={"target_tokens": two, **rl}
                )
            ],
            "importance_sampling",
        ).result()
    except Exception as err:  # noqa: BLE001
        out["soft_rl"] = f"{type(err).__name__}: {err}"
    try:
        a.optim_step(types.AdamParams(learning_rate=-1.0)).result()
    except Exception as err:  # noqa: BLE001
        out["lr"] = f"{type(err).__name__}: {err}"
    out["still_trains"] = a.forward_backward([ce(TOKENS)], "cross_entropy").result().metrics
    return out


def own_refusals(service, model):
    """Calls the SDK numbers and then refuses itself before sending (a `ttl_seconds` that is not
    finite fails its request type's check), and ones the server refuses (a NaN or infinite learning
    rate): each refusal's text, and how long the same client's next call then takes."""
    import math
    import time

    a = client(service, model, seed=37)
    calls = {
        "lr_nan": lambda: a.optim_step(types.AdamParams(learning_rate=math.nan)).result(),
        "lr_inf": lambda: a.optim_step(types.AdamParams(learning_rate=math.inf)).result(),
        "ttl_nan": lambda: a.save_state("s", ttl_seconds=math.nan).result(),
        "weights_ttl_inf": lambda: a.save_weights_for_sampler("w", ttl_seconds=math.inf).result(),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            refused = None
        except Exception as err:  # noqa: BLE001 - what the SDK says is the finding
            refused = f"{type(err).__name__}: {err}"[:300]
        t0 = time.monotonic()
        loss = a.forward([ce(TOKENS)], "cross_entropy").result().metrics["loss:sum"]
        out[name] = {"refused": refused, "next_s": time.monotonic() - t0, "next_loss": loss}
    return out


def inflight(service, model):
    """Inflight samplers (`kind="inflight"`): a sampler made before a later inflight save samples
    the newer weights; a snapshot keeps its own; samples running across the save all finish."""
    a = client(service, model, seed=41)
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0)
    prompt = types.ModelInput.from_ints(TOKENS[:4])

    def step() -> None:
        a.forward_backward([ce(TOKENS)], "cross_entropy").result()
        a.optim_step(types.AdamParams(learning_rate=5e-2)).result()

    def sample(sampler) -> dict:
        s = sampler.sample(prompt, num_samples=1, sampling_params=greedy).result().sequences[0]
        return {"tokens": s.tokens, "logprobs": s.logprobs}

    def trained(tokens: list[int]) -> list[float]:
        return logprobs(a.forward([ce(TOKENS[:4] + tokens)], "cross_entropy").result())[0][3:]

    step()
    first = a.save_weights_and_get_sampling_client(kind="inflight")
    snapshot = a.save_weights_and_get_sampling_client()
    v1 = sample(first)
    v1["trained"] = trained(v1["tokens"])
    for _ in range(3):
        step()
    long = types.SamplingParams(max_tokens=48, temperature=1.0, seed=3)
    running = [first.sample(prompt, num_samples=4, sampling_params=long) for _ in range(4)]
    second = a.save_weights_and_get_sampling_client(kind="inflight")
    across = [len(s.tokens) for f in running for s in f.result().sequences]
    # the save answers before the engine has loaded v2 (the SDK's contract); a client made at v2
    # waits for it, and once the engine has it the first client's next request runs on it too
    newer = sample(second)
    v2 = sample(first)
    v2["trained"] = trained(v2["tokens"])
    return {
        "v1": v1,
        "v2": v2,
        "second": newer,
        "snapshot": sample(snapshot),
        "across": across,
    }


def prompt_logprobs(service, model):
    """The prompt's logprobs from a sampling client (compute_logprobs, with and without
    prompt_logprobs_last_n; the top 3 at each position) beside forward's of the same tokens at the
    same weights."""
    a = client(service, model, seed=47)
    a.forward_backward([ce(TOKENS)], "cross_entropy").result()
    a.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    sampler = a.save_weights_and_get_sampling_client()
    prompt = types.ModelInput.from_ints(TOKENS)
    one = types.SamplingParams(max_tokens=1)
    top = sampler.sample(prompt, 1, one, include_prompt_logprobs=True, topk_prompt_logprobs=3)
    # each position's own next token, and tokens 3 and 4 at some (-1: nothing asked)
    asked = [[t, 3, 4] if i % 2 or i == 4 else [t, -1, -1] for i, t in enumerate(TOKENS[1:])]
    dense = sampler.sample(
        prompt, 1, one, target_prompt_logprobs=types.TensorData.from_torch(torch.tensor(asked))
    ).result()
    # the cookbook's decisions recipe: one position's labels, sent sparse
    from tinker_cookbook.recipes.decisions.decision import DecisionRendering, sample_decision

    rendering = DecisionRendering(tokens=TOKENS, choice_pos=5, label_tokens={"a": 3, "b": 4})
    decision = asyncio.run(sample_decision(sampler, rendering))
    sampled = sampler.sample(
        types.ModelInput.from_ints(TOKENS[:4]),
        2,
        types.SamplingParams(max_tokens=5, seed=3, stop=[]),
        topk_sample_logprobs=3,
    ).result()
    continued = [
        sampler.sample(
            types.ModelInput.from_ints(TOKENS[:4] + s.tokens), 1, one, topk_prompt_logprobs=3
        ).result()
        for s in sampled.sequences
    ]
    return {
        "sampled": sampler.compute_logprobs(prompt).result(),
        "last_3": sampler.compute_logprobs(prompt, prompt_logprobs_last_n=3).result(),
        "top": top.result().topk_prompt_logprobs,
        "trained": logprobs(a.forward([ce(TOKENS)], "cross_entropy").result())[0],
        "trained_3_4": [
            logprobs(a.forward([aimed(TOKENS, t)], "cross_entropy").result())[0] for t in (3, 4)
        ],
        "targets": dense.target_prompt_logprobs.tolist(),
        "targets_prompt_logprobs": dense.prompt_logprobs,
        "decision": decision,
        "sample_top": [
            {"tokens": s.tokens, "logprobs": s.logprobs, "top": s.topk_logprobs}
            for s in sampled.sequences
        ],
        "continued_top": [c.topk_prompt_logprobs for c in continued],
    }


def fields(service, model):
    """What the SDK's fields do here: a checkpoint's TTL and metadata, a client made from a state
    with metadata, the key's sessions, the server's capabilities, and a route Orbit does not serve
    (its error)."""
    import time

    rest = service.create_rest_client()
    a = client(service, model, seed=43)
    a.forward_backward([ce(TOKENS)], "cross_entropy").result()
    short = a.save_state("short", ttl_seconds=2).result().path
    kept = a.save_state("kept", user_metadata={"renderer_name": "role_colon"}).result().path
    listed = {c.tinker_path: c for c in rest.list_user_checkpoints().result().checkpoints}
    b = service.create_training_client_from_state(kept, user_metadata={"from": "kept"})
    run = rest.get_training_run(b.model_id).result()
    rest.set_checkpoint_ttl_from_tinker_path(kept, 3600).result()
    ttl = [
        c for c in rest.list_checkpoints(a.model_id).result().checkpoints if c.tinker_path == kept
    ]
    time.sleep(8)  # past the short one's TTL and a reaper round (every 5 s)
    try:
        rest.get_weights_info_by_tinker_path(short).result()
        expired = None
    except Exception as err:  # noqa: BLE001 - what the SDK says is the finding
        expired = f"{type(err).__name__}: {err}"[:400]
    after = [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints]
    session = a.model_id.split(":")[0]
    info = rest.get_session(session).result()
    rest.publish_checkpoint_from_tinker_path(kept).result()
    published = [
        c.public for c in rest.list_user_checkpoints().result().checkpoints if c.tinker_path == kept
    ]
    rest.unpublish_checkpoint_from_tinker_path(kept).result()
    caps = rest.get_server_capabilities().result()
    wider = service.create_lora_training_client(base_model=model, rank=8, seed=1).result()
    try:
        wider.load_state(kept).result()
        misfit = None
    except Exception as err:  # noqa: BLE001
        misfit = f"{type(err).__name__}: {err}"[:400]
    return {
        "misfit": misfit,
        "short_expires": str(listed[short].expires_at),
        "kept_metadata": listed[kept].user_metadata,
        "run_metadata": run.user_metadata,
        "ttl_set": str(ttl[0].expires_at) if ttl else None,
        "expired": expired,
        "listed_after": after,
        "short": short,
        "kept": kept,
        "sessions": rest.list_sessions().result().sessions,
        "session": session,
        "session_runs": info.training_run_ids,
        "published": published,
        "models": [m.model_name for m in caps.supported_models],
    }


def sessions_search(service, model):
    """RestClient.search_sessions over sessions made with display names and metadata (one closed
    as errored), page by page, and the checkpoint storage usage; a project not the key's."""
    url = os.environ["TINKER_BASE_URL"]
    a = tinker.ServiceClient(
        base_url=url, display_name="Nightly sweep alpha", user_metadata={"team": "rl"}
    )
    trained = client(a, model, seed=1)
    trained.save_state("searched").result()
    b = tinker.ServiceClient(
        base_url=url, display_name="nightly beta", user_metadata={"team": "sl"}
    )
    other = client(b, model, seed=2)
    b.close("errored", detail="diverged").result()
    rest = service.create_rest_client()

    def search(**kw) -> tuple[list[str], object]:
        page = rest.search_sessions(types.SessionSearchRequest(**kw)).result()
        return [s.session_id for s in page.sessions], page

    first, page = search(display_name="nightly", limit=1)
    second, last = search(display_name="nightly", limit=1, cursor=page.next_cursor)
    words, found = search(display_name="ALPHA nightly")
    finished = types.ClientFinishedSessionStatusQuery(reasons=["errored"])
    usage = rest.get_current_checkpoint_storage_usage().result()
    return {
        "a": trained.model_id.split(":")[0],
        "b": other.model_id.split(":")[0],
        "pages": [first, second, last.next_cursor is None],
        "words": words,
        "summary": found.sessions[0].model_dump(mode="json"),
        "team_sl": search(user_metadata={"team": "sl"})[0],
        "active": search(statuses=[types.ActiveSessionStatusQuery()], limit=200)[0],
        "errored": search(statuses=[finished])[0],
        "b_status": search(session_id=other.model_id.split(":")[0])[1]
        .sessions[0]
        .status.model_dump(mode="json"),
        "usage": usage.model_dump(mode="json"),
        "other_project": _refused(lambda: search(project_ids=["someone-else"])),
    }


def copies(service, model):
    """RestClient.copy_weights: a training checkpoint copied into the key's one project (its
    name: a session's project_id), a client made from the copy (it continues exactly), the copy's
    run (not trainable), and what is refused."""
    rest = service.create_rest_client()
    a = client(service, model, seed=47)
    a.forward_backward([ce(TOKENS)], "cross_entropy").result()
    a.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    source = a.save_state("to-copy", user_metadata={"why": "archive"}).result().path
    session = a.model_id.split(":")[0]
    page = rest.search_sessions(types.SessionSearchRequest(session_id=session)).result()
    project = page.sessions[0].project_id
    copied = rest.copy_weights(source, project, ttl_seconds=7200).result()
    listed = [
        c for c in rest.list_user_checkpoints().result().checkpoints if c.tinker_path == copied
    ]
    b = service.create_training_client_from_state_with_optimizer(copied)
    for c in (a, b):
        c.forward_backward([ce(TOKENS)], "cross_entropy").result()
        c.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    run = copied.removeprefix("tinker://").split("/")[0]
    return {
        "source": source,
        "copied": copied,
        "metadata": listed[0].user_metadata if listed else None,
        "expires": str(listed[0].expires_at) if listed else None,
        "continued": [
            logprobs(c.forward([ce(TOKENS)], "cross_entropy").result())[0] for c in (a, b)
        ],
        "run": rest.get_training_run(run).result().model_dump(mode="json"),
        "other_project": _refused(lambda: rest.copy_weights(source, "someone-else").result()),
        "short_ttl": _refused(lambda: rest.copy_weights(source, project, ttl_seconds=60).result()),
        "token": _refused(
            lambda: rest.copy_weights(source, project, weights_access_token="t").result()
        ),
        "assigned": _refused(lambda: rest.assign_session_project(session, project).result()),
        "assigned_other": _refused(
            lambda: rest.assign_session_project(session, "someone-else").result()
        ),
    }


def sampling(service, model):
    """SamplingParams as the engines honour them, and sampling from the base model."""
    base = service.create_sampling_client(base_model=model)
    prompt = types.ModelInput.from_ints(TOKENS[:4])

    def sample(**kw) -> list[dict]:
        params = types.SamplingParams(**{"max_tokens": 12, **kw})
        result = base.sample(prompt, 2, params).result()
        return [
            {"tokens": s.tokens, "logprobs": s.logprobs, "stop": s.stop_reason}
            for s in result.sequences
        ]

    fresh = client(service, model, seed=31)  # LoRA B = 0: the base model
    greedy = sample(temperature=0.0)
    scored = logprobs(
        fresh.forward([ce(TOKENS[:4] + greedy[0]["tokens"])], "cross_entropy").result()
    )
    return {
        "seeded": [sample(seed=5), sample(seed=5)],
        "greedy": greedy,
        "top_k_1": sample(top_k=1),
        "stop_token": sample(temperature=0.0, stop=[greedy[0]["tokens"][2]]),
        "tokenizer": type(fresh.get_tokenizer()).__name__,
        "base_scored": scored[0][3:],
    }


def two_models(service, student, teacher):
    """Two base models of one service by name: the capabilities list both; a training client on
    each; the teacher trained a step and saved for a sampler; logprobs of the same tokens from each
    base's sampler, the teacher's checkpoint's and each client's forward; a model not served."""
    rest = service.create_rest_client()
    caps = rest.get_server_capabilities().result()
    s, t = client(service, student, seed=3), client(service, teacher, seed=3)

    def forward(c) -> list[float]:
        return logprobs(c.forward([ce(TOKENS)], "cross_entropy").result())[0]

    def prompt(sampler) -> list[float]:
        return sampler.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()[1:]

    before = {"student": forward(s), "teacher": forward(t)}
    bases = {
        "student": prompt(service.create_sampling_client(base_model=student)),
        "teacher": prompt(service.create_sampling_client(base_model=teacher)),
    }
    t.forward_backward([ce(TOKENS)], "cross_entropy").result()
    t.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    saved = t.save_weights_for_sampler("teacher-1").result().path
    trained = forward(t)
    from_path = service.create_sampling_client(model_path=saved)
    sampled = from_path.sample(
        types.ModelInput.from_ints(TOKENS[:4]), 1, types.SamplingParams(max_tokens=6, seed=1)
    ).result()
    state = t.save_state("teacher-s").result().path
    again = service.create_training_client_from_state(state)
    snapshot = t.save_weights_and_get_sampling_client()  # an unnamed snapshot, on the teacher
    return {
        "snapshot": prompt(snapshot),
        "across": _refused(lambda: s.load_state(state).result()),
        "models": [m.model_name for m in caps.supported_models],
        "before": before,
        "bases": bases,
        "trained": trained,
        "checkpoint": prompt(from_path),
        "sampled": sampled.sequences[0].tokens,
        "info": [s.get_info().model_data.model_name, t.get_info().model_data.model_name],
        "from_state": again.get_info().model_data.model_name,
        "from_state_forward": forward(again),
        "nobody": _refused(lambda: client(service, "nobody")),
    }


CHECKS = {
    f.__name__: f
    for f in (
        accumulate,
        soft_targets,
        exports,
        forward_only,
        sampler_keeps_its_weights,
        sampler_and_trainer_agree,
        losses,
        stable_reinforce,
        lr_zero,
        state_round_trip,
        refusals,
        own_refusals,
        inflight,
        prompt_logprobs,
        fields,
        sampling,
        two_models,
        sessions_search,
        copies,
    )
}

if __name__ == "__main__":
    base_url, model, check = sys.argv[1], sys.argv[2], sys.argv[3]
    # the key: TINKER_API_KEY. The session is left open, not closed: the tests read its clients'
    # adapters after this process ends, and a closed session releases them
    # (tests/test_serve_service.py)
    os.environ["TINKER_BASE_URL"] = base_url  # for what the cookbook opens itself
    service = tinker.ServiceClient(base_url=base_url)
    result = CHECKS[check](service, model, *sys.argv[4:])
    print("RESULT " + json.dumps(result), flush=True)
    # The SDK's event loop runs forever in a daemon thread: finalizing the interpreter beside it
    # aborted this process (SIGABRT, after its RESULT line) in a clean clone's run on a busy
    # machine. The result is out: leave without finalizing.
    sys.stderr.flush()
    os._exit(0)
