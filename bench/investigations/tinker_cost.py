"""What `orbit serve` costs: a cookbook-sized RL step through the real `tinker` SDK against the same
work done by Orbit's own trainer and engine in this process, and a sampler's weights reaching the
engine as a slot push (an unnamed snapshot) against a save to disk and a load (a named checkpoint).

    .venv/bin/python bench/investigations/tinker_cost.py [--model .cache/smollm2-135m-instruct]
        [--steps 3]

The batch is math_rl's on SmolLM2 (tinker-cookbook, env=arithmetic): 8 groups of 8 samples of up to
8 tokens after a 34-token prompt. Needs `make tinker` (the SDK runs in .venv-tinker). Prints a
table; the figures are in bench/investigations/service.md ("What `orbit serve` costs").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import torch

ROOT = Path(__file__).resolve().parents[2]
PROMPT, NEW, SAMPLES = 34, 8, 64

CLIENT = r"""
import json, os, sys, time
os.environ["TINKER_TELEMETRY"] = "0"
import tinker
from tinker import types
url, model, steps, prompt_len, new, n = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
service = tinker.ServiceClient(base_url=url, api_key="tml-local")
client = service.create_lora_training_client(base_model=model, rank=8).result()
prompt = types.ModelInput.from_ints(list(range(100, 100 + prompt_len)))
params = types.SamplingParams(max_tokens=new, temperature=1.0, seed=0)
out = {"sample_s": [], "train_s": [], "snapshot_s": [], "disk_s": []}
for step in range(steps):
    t0 = time.time()
    sampler = client.save_weights_and_get_sampling_client()
    first = sampler.sample(prompt, 1, params).result()
    out["snapshot_s"].append(time.time() - t0)
    t0 = time.time()
    path = client.save_weights_for_sampler(f"s{step}").result().path
    disk = service.create_sampling_client(model_path=path)
    disk.sample(prompt, 1, params).result()
    out["disk_s"].append(time.time() - t0)
    t0 = time.time()
    futures = [sampler.sample(prompt, 1, params) for _ in range(n)]
    seqs = [f.result().sequences[0] for f in futures]
    out["sample_s"].append(time.time() - t0)
    data = []
    for s in seqs:
        tokens = list(range(100, 100 + prompt_len)) + s.tokens
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:],
                            "logprobs": [0.0] * (prompt_len - 1) + s.logprobs,
                            "advantages": [0.0] * (prompt_len - 1) + [0.5] * len(s.tokens)}))
    t0 = time.time()
    client.forward_backward(data, "importance_sampling").result()
    client.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    out["train_s"].append(time.time() - t0)
print("RESULT " + json.dumps(out))
"""


def through_the_sdk(model: Path, steps: int) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from orbit.config import parse_recipe
    from orbit.serve.command import Options, serving

    recipe = parse_recipe(
        {
            "model": str(model),
            "engine": {"backend": "embedded", "slots": 4, "max_running": 64, "max_context": 1024},
        }
    )
    with (
        tempfile.TemporaryDirectory() as tmp,
        serving(recipe, Options(directory=Path(tmp))) as (url, _),
    ):
        res = subprocess.run(
            [
                str(ROOT / ".venv-tinker" / "bin" / "python"),
                "-c",
                CLIENT,
                url,
                str(model.resolve()),
                str(steps),
                str(PROMPT),
                str(NEW),
                str(SAMPLES),
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            timeout=1800,
        )
    lines = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
    if not lines:
        sys.exit(f"the SDK client failed:\n{res.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def in_orbit(model: Path, steps: int) -> dict:
    """The same work by Orbit's own pieces: the engine's 64 generations, the trainer's step on them
    (orbit/train/trainer.py: the RL loop's trainer, importance weights against the engine's
    logprobs)."""
    from orbit.config import AdapterConfig, TrainerConfig
    from orbit.engine.base import SamplingParams
    from orbit.engine.embedded import start_embedded_engine
    from orbit.rollout.sample import Sample
    from orbit.train.trainer import Trainer

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    trainer = Trainer(
        model, AdapterConfig(r=8, alpha=32, target_modules=targets), TrainerConfig(), 1.0, 0
    )
    out: dict[str, list[float]] = {"sample_s": [], "train_s": []}
    prompt = list(range(100, 100 + PROMPT))
    with start_embedded_engine(model, max_running=SAMPLES, max_context=1024) as engine:
        engine.load_adapter(0, trainer.adapter_tensors(), trainer.adapter_config(), 1)
        for step in range(steps):
            t0 = time.time()
            futures = [
                engine.generate(prompt, SamplingParams(max_new_tokens=NEW, seed=i), slot=0)
                for i in range(SAMPLES)
            ]
            done = [f.result() for f in futures]
            out["sample_s"].append(time.time() - t0)
            samples = [
                Sample(
                    prompt,
                    d.output_ids,
                    d.logprobs,
                    reward=0.0,
                    advantage=0.5,
                    version_start=step,
                    version_end=step,
                    group_id=i // 8,
                )
                for i, d in enumerate(done)
            ]
            t0 = time.time()
            trainer.step(samples)
            out["train_s"].append(time.time() - t0)
    trainer.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=ROOT / ".cache" / "smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sdk = through_the_sdk(args.model, args.steps)
    own = in_orbit(args.model, args.steps)
    print(
        f"{SAMPLES} samples of <= {NEW} tokens after {PROMPT}, then a step on them; medians of "
        f"{args.steps}"
    )
    print("| | through the SDK | Orbit's own loop | SDK / Orbit |\n|---|---|---|---|")
    for key in ("sample_s", "train_s"):
        a, b = median(sdk[key]), median(own[key])
        print(f"| {key} | {a:.2f} s | {b:.2f} s | {a / b:.2f}x |")
    print(f"| a snapshot's slot push + first sample | {median(sdk['snapshot_s']):.3f} s | | |")
    print(f"| save to disk + load + first sample | {median(sdk['disk_s']):.3f} s | | |")


if __name__ == "__main__":
    main()
