"""Train tokens/s and peak memory of one RL step on a real vocabulary: the plain way against
Orbit's.

On a 49k vocabulary the fp32 logits of a whole batch are the biggest tensor of a step. Three ways of
the same GRPO step on the same batch (groups of samples sharing a prompt, as rollouts give them):
- plain:        one forward of the padded batch through transformers + peft, full logits,
  log_softmax
                over the vocabulary, gather, backward (what a straightforward trainer does);
- orbit:        Orbit's Trainer.step with `micro_batch_tokens: 0`: one forward, the output
  projection
                and log-softmax taken CHUNK_ROWS positions at a time (orbit/train/batch.py);
- orbit-micro:  the same with `micro_batch_tokens: 512`: micro-batches of similar length, gradients
                accumulated, so memory is bounded by the budget and not by the batch.
Each runs in its own process (peak RSS is per process): the figure is the peak RSS of the step above
the RSS once the model is loaded. Tokens/s counts the tokens forwarded (prompts and outputs), median
of 3 steps after one warm-up, one torch thread.

    .venv/bin/python bench/investigations/trainer_memory.py [--model .cache/smollm2-135m-instruct]
        [--samples 32]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WAYS = ("plain", "orbit", "orbit-micro")


def samples(n: int, group: int, prompt_len: int, output_len: int, vocab: int):
    import random

    from orbit.rollout.sample import Sample

    rng = random.Random(0)
    out = []
    for g in range(n // group):
        prompt = [rng.randrange(10, vocab) for _ in range(prompt_len)]
        for _ in range(group):
            k = rng.randint(output_len // 2, output_len)
            out.append(
                Sample(
                    prompt,
                    [rng.randrange(10, vocab) for _ in range(k)],
                    [-3.0] * k,
                    rng.random(),
                    0,
                    0,
                    advantage=rng.gauss(0, 1),
                    group_id=g,
                )
            )
    return out


def plain_step(model, optimizer, batch) -> None:
    import torch

    width = max(len(s.prompt_ids) + len(s.output_ids) for s in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    loss_mask = torch.zeros(len(batch), width - 1)
    adv = torch.tensor([s.advantage for s in batch])
    for i, s in enumerate(batch):
        seq = s.prompt_ids + s.output_ids
        ids[i, : len(seq)], mask[i, : len(seq)] = torch.tensor(seq), 1
        loss_mask[i, len(s.prompt_ids) - 1 : len(seq) - 1] = 1
    optimizer.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    loss = -(adv[:, None] * logp * loss_mask).sum() / loss_mask.sum()
    loss.backward()
    optimizer.step()


def measure(way: str, args) -> dict:
    import torch

    from orbit.config import AdapterConfig, TrainerConfig
    from orbit.train.trainer import Trainer

    torch.set_num_threads(1)
    adapter = AdapterConfig(type="lora", r=16, alpha=32)
    budget = 512 if way == "orbit-micro" else 0
    trainer = Trainer(
        args.model, adapter, TrainerConfig(lr=1e-5, micro_batch_tokens=budget), 1.0, 0
    )
    vocab = trainer.model.config.vocab_size
    batch = samples(args.samples, args.group, args.prompt, args.output, vocab)
    # MB, the peak so far: the model
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    step = (
        (lambda: plain_step(trainer.model, trainer.optimizer, batch))
        if way == "plain"
        else (lambda: trainer.step(batch))
    )
    step()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    tokens = sum(len(s.prompt_ids) + len(s.output_ids) for s in batch)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    return {
        "way": way,
        "tokens": tokens,
        "step_s": statistics.median(times),
        "tok_s": tokens / statistics.median(times),
        "peak_mb": peak - loaded,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, default=ROOT / ".cache" / "smollm2-135m-instruct")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--group", type=int, default=8, help="samples sharing a prompt")
    ap.add_argument("--prompt", type=int, default=48, help="prompt tokens")
    ap.add_argument(
        "--output", type=int, default=64, help="at most this many output tokens (at least half)"
    )
    # one way, in this process
    ap.add_argument("--way", choices=WAYS, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.way:
        print(json.dumps(measure(args.way, args)))
        return
    rows = []
    for way in WAYS:
        out = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--way", way],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(
        f"model {args.model.name}: {args.samples} samples in groups of {args.group}, prompts of "
        f"{args.prompt} tokens, outputs {args.output // 2}..{args.output}; {rows[0]['tokens']} "
        "tokens a step, 1 torch thread"
    )
    print(f"{'way':12s} {'step s':>7s} {'tok/s':>7s} {'peak MB above the model':>24s}")
    for r in rows:
        print(f"{r['way']:12s} {r['step_s']:7.2f} {r['tok_s']:7.0f} {r['peak_mb']:24.0f}")
    base = rows[0]
    for r in rows[1:]:
        print(
            f"{r['way']} vs plain: {r['tok_s'] / base['tok_s']:.2f}x tokens/s, "
            f"{r['peak_mb'] / base['peak_mb']:.2f}x peak memory"
        )


if __name__ == "__main__":
    main()
