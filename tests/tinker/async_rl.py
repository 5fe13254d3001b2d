"""An async RL loop of our own through the real `tinker` SDK (run in .venv-tinker, make tinker), on
inflight samplers or on snapshots: `python async_rl.py BASE_URL MODEL async '{"kind": ...}'` prints
one JSON line of each step's wall time, reward and staleness.

The loop, top to bottom:
- the task: sums ("12+7="), reward 1 when the completion's first number is the sum, 0.1 when it at
  least starts with a digit (so a tiny random model sees some signal);
- producers (threads) sample groups while the trainer trains: at most `groups * (off_policy + 1)`
  groups started and not yet trained, so a group is at most `off_policy` steps stale when trained;
- the trainer takes the `groups` oldest finished groups, centres each group's rewards
  (GRPO's advantage without the std), trains with `importance_sampling` on the sampler's logprobs,
  takes an Adam step, and publishes the new weights:
  - `inflight`: `save_weights_and_get_sampling_client(kind="inflight")`; the producers keep sampling
    from the first inflight client, which samples the newest published weights;
  - `snapshot`: `save_weights_and_get_sampling_client()`; the producers move to the new client.
"""

from __future__ import annotations

import json
import os
import queue
import random
import re
import sys
import threading
import time
from dataclasses import dataclass

os.environ.setdefault("TINKER_TELEMETRY", "0")

import tinker  # noqa: E402
from tinker import types  # noqa: E402


@dataclass
class Group:
    version: int  # the trainer's steps when its sampling began
    prompt: list[int]
    answer: int
    sequences: list  # the SDK's SampledSequence


def reward(text: str, answer: int) -> float:
    found = re.match(r"\s*(-?\d+)", text)
    if found is None:
        return 0.0
    return 1.0 if int(found.group(1)) == answer else 0.1


def datums(group: Group, tokenizer) -> tuple[list[types.Datum], float]:
    """The group's samples as importance-sampling datums, and its mean reward."""
    rewards = [reward(tokenizer.decode(s.tokens), group.answer) for s in group.sequences]
    mean = sum(rewards) / len(rewards)
    out = []
    for s, r in zip(group.sequences, rewards, strict=True):
        if r == mean or not s.tokens:
            continue  # no signal
        tokens = group.prompt + list(s.tokens)
        n = len(tokens) - 1
        prompt = len(group.prompt) - 1  # the prompt's targets carry no advantage
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": tokens[1:],
                    "logprobs": [0.0] * prompt + list(s.logprobs),
                    "advantages": [0.0] * prompt + [r - mean] * (n - prompt),
                },
            )
        )
    return out, mean


def run(service: tinker.ServiceClient, model: str, spec: dict) -> dict:
    kind, steps, groups = spec["kind"], spec["steps"], spec["groups"]
    size, off_policy = spec["group_size"], spec["off_policy"]
    params = types.SamplingParams(max_tokens=spec["max_tokens"], temperature=1.0, stop=["\n"])
    trainer = service.create_lora_training_client(base_model=model, rank=8, seed=spec["seed"])
    tokenizer = trainer.get_tokenizer()
    rng = random.Random(spec["seed"])
    lock = threading.Lock()
    state = {"version": 0, "sampler": trainer.save_weights_and_get_sampling_client(kind=kind)}
    room = threading.Semaphore(groups * (off_policy + 1))
    done: queue.Queue[Group | BaseException] = queue.Queue()
    stop = threading.Event()

    def produce() -> None:
        while not stop.is_set():
            if not room.acquire(timeout=0.5):
                continue
            with lock:
                a, b = rng.randint(1, 50), rng.randint(1, 50)
                version, sampler = state["version"], state["sampler"]
            prompt = tokenizer.encode(f"{a}+{b}=", add_special_tokens=False)
            try:
                result = sampler.sample(types.ModelInput.from_ints(prompt), size, params).result()
            except BaseException as err:  # noqa: BLE001 - the trainer raises it
                done.put(err)
                return
            done.put(Group(version, prompt, a + b, list(result.sequences)))

    workers = [threading.Thread(target=produce, daemon=True) for _ in range(groups)]
    for w in workers:
        w.start()
    rows = []
    t0 = time.monotonic()
    try:
        for step in range(steps):
            batch = []
            while len(batch) < groups:
                got = done.get(timeout=600)
                if isinstance(got, BaseException):
                    raise got
                batch.append(got)
            data, rewards = [], []
            for group in batch:
                d, r = datums(group, tokenizer)
                data += d
                rewards.append(r)
            if data:
                trainer.forward_backward(data, "importance_sampling").result()
            trainer.optim_step(types.AdamParams(learning_rate=spec["lr"])).result()
            publish = trainer.save_weights_and_get_sampling_client(kind=kind)
            with lock:
                state["version"] = step + 1
                if kind == "snapshot":
                    state["sampler"] = publish
            for _ in batch:
                room.release()
            now = time.monotonic()
            rows.append(
                {
                    "step": step,
                    "seconds": now - t0,
                    "reward": sum(rewards) / len(rewards),
                    "staleness": [step - g.version for g in batch],
                    "trained": len(data),
                }
            )
            t0 = now
    finally:
        stop.set()
        for w in workers:
            w.join(60)
    return {"kind": kind, "model_id": trainer.model_id, "steps": rows}


if __name__ == "__main__":
    base_url, model, _, arg = sys.argv[1:5]
    # left open, not closed: the caller reads the service's state after this process ends
    client = tinker.ServiceClient(base_url=base_url)
    print("RESULT " + json.dumps(run(client, model, json.loads(arg))), flush=True)
