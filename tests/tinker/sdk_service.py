"""Run by tests/test_serve_service.py in .venv-tinker (make tinker): the real `tinker` SDK 0.38
against an `orbit serve` shared by tenants, restarted, and loaded. `python sdk_service.py BASE_URL
MODEL STEP [ARG]` runs one step with the key in TINKER_API_KEY and prints one JSON line of what it
saw."""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("TINKER_TELEMETRY", "0")

import tinker  # noqa: E402
from tinker import types  # noqa: E402

TOKENS = [1, 5, 9, 13, 17, 21, 25, 29, 33, 37]


def ce(step: int) -> list[types.Datum]:
    """The batch of step `step`: the same for every run that takes that step."""
    tokens = TOKENS[step % 3 :] + [41 + step, 3 + step]
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
    ]


ADAM = types.AdamParams(learning_rate=1e-2)


def group(client: int, step: int, spec: dict) -> list[types.Datum]:
    """An RL-shaped batch: `group` sequences of one `prompt`-token prompt (the client's and the
    step's own) and `completion` tokens each, trained on the completion (weight 1) only."""
    import random

    rng = random.Random(client * 1000 + step)
    vocab = spec.get("vocab", 1000)
    prompt = [rng.randrange(3, vocab) for _ in range(spec["prompt"])]
    out = []
    for _ in range(spec["group"]):
        tokens = prompt + [rng.randrange(3, vocab) for _ in range(spec["completion"])]
        weights = [0.0] * (len(prompt) - 1) + [1.0] * spec["completion"]
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
            )
        )
    return out


def train(client, steps: range) -> None:
    for step in steps:
        client.forward_backward(ce(step), "cross_entropy").result()
        client.optim_step(ADAM).result()


def failure(future) -> str:
    """The error a future ended with ('' when it succeeded)."""
    try:
        future.result()
    except Exception as err:  # noqa: BLE001 - what the SDK surfaced
        return f"{type(err).__name__}: {err}"
    return ""


# ---- tenants --------------------------------------------------------------------------------


def owner(service, model, _):
    """Key A's things: a training client, its state, a named sampler and a sampling session."""
    a = service.create_lora_training_client(base_model=model, rank=4, seed=1).result()
    train(a, range(1))
    state = a.save_state("a-state").result().path
    sampler_path = a.save_weights_for_sampler("a-sampler").result().path
    sampler = a.create_sampling_client(sampler_path)
    if hasattr(sampler, "result"):
        sampler = sampler.result()
    return {
        "model_id": a.model_id,
        "state": state,
        "sampler_path": sampler_path,
        "sampler_id": sampler._sampling_session_id,
    }


def intruder(service, model, arg):
    """Key B against key A's things, through every SDK call that takes one of them."""
    a = json.loads(arg)
    rest = service.create_rest_client()
    b = service.create_lora_training_client(base_model=model, rank=4, seed=2).result()
    seen = {
        "runs": [r.training_run_id for r in rest.list_training_runs().result().training_runs],
        "checkpoints": [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints],
    }
    attempts = {
        "get_run": lambda: rest.get_training_run(a["model_id"]),
        "run_checkpoints": lambda: rest.list_checkpoints(a["model_id"]),
        "weights_info": lambda: rest.get_weights_info_by_tinker_path(a["state"]),
        "delete": lambda: rest.delete_checkpoint_from_tinker_path(a["state"]),
        "sample_path": lambda: (
            service.create_sampling_client(model_path=a["sampler_path"])
            .result()
            .sample(types.ModelInput.from_ints(TOKENS[:3]), 1, types.SamplingParams(max_tokens=2))
        ),
        "load_state": lambda: b.load_state(a["state"]),
        "from_state": lambda: service.create_training_client_from_state(a["state"]).result(),
    }
    for name, attempt in attempts.items():
        try:
            out = attempt()
            seen[name] = failure(out) if hasattr(out, "result") else "served"
        except Exception as err:  # noqa: BLE001 - what the SDK surfaced
            seen[name] = f"{type(err).__name__}: {err}"
    seen["own_run"] = b.model_id
    return seen


def publisher(service, model, arg):
    """Key A: a state and a sampler's weights, published (`arg` "publish") or taken back."""
    rest = service.create_rest_client()
    if arg != "publish":
        paths = json.loads(arg)
        for path in (paths["state"], paths["sampler_path"]):
            rest.unpublish_checkpoint_from_tinker_path(path).result()
        return {
            "listed": [
                c.public for c in rest.list_checkpoints(paths["model_id"]).result().checkpoints
            ]
        }
    a = service.create_lora_training_client(base_model=model, rank=4, seed=3).result()
    train(a, range(1))
    state = a.save_state("pub-state").result().path
    sampler_path = a.save_weights_for_sampler("pub-sampler").result().path
    for path in (state, sampler_path):
        rest.publish_checkpoint_from_tinker_path(path).result()
    listed = rest.list_checkpoints(a.model_id).result().checkpoints
    return {
        "model_id": a.model_id,
        "state": state,
        "sampler_path": sampler_path,
        "listed": [c.public for c in listed],
    }


def reader(service, model, arg):
    """Key B against key A's published checkpoints: what it may do (sample, load) and may not."""
    a = json.loads(arg)
    rest = service.create_rest_client()
    attempts = {
        "sample_path": lambda: (
            service.create_sampling_client(model_path=a["sampler_path"])
            .sample(types.ModelInput.from_ints(TOKENS[:3]), 1, types.SamplingParams(max_tokens=2))
            .result()
        ),
        "from_state": lambda: service.create_training_client_from_state(a["state"]).result(),
        "weights_info": lambda: rest.get_weights_info_by_tinker_path(a["state"]).result(),
        "delete": lambda: rest.delete_checkpoint_from_tinker_path(a["state"]).result(),
        "unpublish": lambda: rest.unpublish_checkpoint_from_tinker_path(a["state"]).result(),
        "ttl": lambda: rest.set_checkpoint_ttl_from_tinker_path(a["state"], 60).result(),
    }
    seen = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            seen[name] = "served"
        except Exception as err:  # noqa: BLE001 - what the SDK surfaced
            seen[name] = f"{type(err).__name__}: {err}"
    seen["listed"] = [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints]
    return seen


# ---- restarts -------------------------------------------------------------------------------


def before_kill(service, model, _):
    """Two steps, a saved state, then a third step whose optim_step the server dies in."""
    a = service.create_lora_training_client(base_model=model, rank=4, seed=11).result()
    train(a, range(2))
    state = a.save_state("s2").result().path
    a.forward_backward(ce(2), "cross_entropy").result()
    print("OPTIM_STEP", flush=True)
    started = time.time()
    lost = failure(a.optim_step(ADAM))
    return {"state": state, "lost": lost, "waited_s": time.time() - started}


def resume_then_kill(service, model, arg):
    """From the saved state, steps 3 and 4, save `latest`, step 5, and a save of `latest` over it
    that the server dies in."""
    a = service.create_training_client_from_state_with_optimizer(arg).result()
    train(a, range(2, 4))
    latest = a.save_state("latest").result().path
    train(a, range(4, 5))
    print("SAVING", flush=True)
    lost = failure(a.save_state("latest", overwrite=True))
    return {"latest": latest, "lost": lost}


def after(service, model, _):
    """What the restarted service holds, and a run never killed: 4 steps, saved as `ref`."""
    rest = service.create_rest_client()
    paths = [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints]
    ref = service.create_lora_training_client(base_model=model, rank=4, seed=11).result()
    train(ref, range(4))
    return {"checkpoints": paths, "ref": ref.save_state("ref").result().path}


def crowd(service, model, arg):
    """Training clients until the service refuses one: what the SDK raised, and how many were
    made."""
    made = 0
    while made < int(arg):
        try:
            service.create_lora_training_client(base_model=model, rank=4).result()
        except Exception as err:  # noqa: BLE001 - what the SDK surfaced
            return {"made": made, "refused": f"{type(err).__name__}: {err}"}
        made += 1
    return {"made": made, "refused": ""}


# ---- load ------------------------------------------------------------------------------------


def load(service, model, arg):
    """`clients` training clients and `samplers` sampling clients at once, each in a thread of its
    own: every training client takes `steps` steps (forward_backward, optim_step), every sampler
    asks for `steps` samples. Each request's latency, and when each client finished. With `group`
    in the spec, a step's batch is `group` (RL-shaped) rather than `ce`'s one short sequence."""
    import threading

    spec = json.loads(arg)
    start = time.time()
    seen: dict[str, dict] = {}

    def timed(name: str, kind: str, future):
        t = time.time()
        out = future.result()
        seen[name].setdefault(kind, []).append(time.time() - t)
        seen[name].setdefault(f"{kind}_done_s", []).append(time.time() - start)
        return out

    def trainer(i: int) -> None:
        name = f"train{i}"
        seen[name] = {}
        c = service.create_lora_training_client(base_model=model, rank=4, seed=i).result()
        seen[name]["created_s"] = time.time() - start
        for step in range(spec["steps"]):
            data = group(i, step, spec) if "group" in spec else ce(step + i)
            seen[name].setdefault("tokens", []).append(sum(d.model_input.length for d in data))
            timed(name, "forward_backward", c.forward_backward(data, "cross_entropy"))
            timed(name, "optim_step", c.optim_step(ADAM))
        seen[name]["finished_s"] = time.time() - start

    def sampler(i: int) -> None:
        name = f"sample{i}"
        seen[name] = {}
        c = service.create_sampling_client(base_model=model)
        c = c.result() if hasattr(c, "result") else c
        prompt = types.ModelInput.from_ints(TOKENS[: 3 + i % 4])
        params = types.SamplingParams(max_tokens=spec.get("max_tokens", 8), seed=i)
        for _ in range(spec["steps"]):
            timed(name, "asample", c.sample(prompt, spec.get("num_samples", 2), params))
        seen[name]["finished_s"] = time.time() - start

    def noted(fn, i: int) -> None:
        """A client's thread; what ended it early is in its record (a thread's error is lost)."""
        try:
            fn(i)
        except Exception as err:  # noqa: BLE001 - what the SDK surfaced
            kind = "train" if fn is trainer else "sample"
            seen.setdefault(f"{kind}{i}", {})["error"] = f"{type(err).__name__}: {err}"[:2000]

    threads = [threading.Thread(target=noted, args=(trainer, i)) for i in range(spec["clients"])]
    threads += [threading.Thread(target=noted, args=(sampler, i)) for i in range(spec["samplers"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"seconds": time.time() - start, "clients": seen}


def ends(service, model, url):
    """A session of its own that closes, as a script's `with ServiceClient()` does at its end:
    what it made, and a client made again from its saved state (in this, open, session)."""
    own = tinker.ServiceClient(base_url=url)
    a = own.create_lora_training_client(base_model=model, rank=4, seed=3).result()
    train(a, range(1))
    state = a.save_state("ends-state").result().path
    sampler = a.save_weights_and_get_sampling_client()
    if hasattr(sampler, "result"):
        sampler = sampler.result()
    own.close("success").result()
    again = service.create_training_client_from_state(state)
    if hasattr(again, "result"):
        again = again.result()
    train(again, range(1, 2))
    return {
        "model_id": a.model_id,
        "state": state,
        "sampler_id": sampler._sampling_session_id,
        "again": again.model_id,
    }


STEPS = {
    f.__name__: f
    for f in (
        owner,
        intruder,
        publisher,
        reader,
        before_kill,
        resume_then_kill,
        after,
        crowd,
        load,
        ends,
    )
}

if __name__ == "__main__":
    base_url, model, step = sys.argv[1], sys.argv[2], sys.argv[3]
    arg = sys.argv[4] if len(sys.argv) > 4 else ""
    # left open, not closed: the tests use its clients after this process ends, and a closed
    # session releases them (`ends` closes its own)
    service = tinker.ServiceClient(base_url=base_url)
    result = STEPS[step](service, model, arg)
    print("RESULT " + json.dumps(result), flush=True)
    # The SDK's event loop runs forever in a daemon thread: finalizing the interpreter beside it
    # aborted this process (SIGABRT, after its RESULT line) in a clean clone's run on a busy
    # machine. The result is out: leave without finalizing.
    sys.stderr.flush()
    os._exit(0)
