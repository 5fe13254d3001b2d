"""The trainer's step time with one rank against two, side by side in one run, on a train-bound
batch.

The same GRPO batch (groups of samples sharing a prompt) and seed, one torch thread per rank:
- 1 rank:            Orbit's Trainer in this process;
- 2 ranks:           two trainer ranks started by torch's launcher (gloo on CPU, nccl on GPUs), each
                     training its share of the tokens, the adapter's gradients summed
                     (orbit/train/ranks.py);
- 2 ranks, fsdp:     the same with the frozen base sharded over the ranks (FSDP2).
Median step time of `--steps` steps after one warm-up; the ratio is 1 rank's time over N ranks'. On
a 2-core machine two ranks are the whole machine: nothing else should run meanwhile.

    .venv/bin/python bench/investigations/trainer_ranks.py [--model .cache/smollm2-135m-instruct]
    [--samples 32] [--device cpu]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def batch(n: int, group: int, prompt_len: int, output_len: int, vocab: int):
    from orbit.rollout.sample import Sample

    rng = random.Random(0)
    out = []
    for g in range(n // group):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        for _ in range(group):
            # outputs of different lengths, as rollouts give
            m = rng.randrange(output_len // 2, output_len + 1)
            out.append(
                Sample(
                    prompt_ids=prompt,
                    output_ids=[rng.randrange(3, vocab) for _ in range(m)],
                    behaviour_logprobs=[-3.0] * m,
                    reward=0.0,
                    version_start=0,
                    version_end=0,
                    loss_mask=[1] * m,
                    advantage=rng.uniform(-1, 1),
                    group_id=g,
                )
            )
    return out


def time_steps(args: argparse.Namespace, shard: str, ranks=None) -> list[float]:
    import torch
    from transformers import AutoConfig

    from orbit.config import AdapterConfig, TrainerConfig
    from orbit.train.trainer import Trainer

    torch.set_num_threads(1)
    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    cfg = TrainerConfig(lr=1e-5, micro_batch_tokens=args.micro, shard=shard, device=args.device)
    trainer = Trainer(args.model, AdapterConfig(r=16, alpha=32), cfg, 1.0, 0, ranks=ranks)
    if ranks is not None and not ranks.leader:
        trainer.follow()
        return []
    samples = batch(args.samples, 8, args.prompt, args.output, vocab)
    times = []
    for _ in range(args.steps + 1):
        t = time.perf_counter()
        trainer.step(samples)
        times.append(time.perf_counter() - t)
    trainer.close()
    return times[1:]


def rank_main(args: argparse.Namespace, shard: str) -> list[float]:
    from orbit.train.launcher import launched
    from orbit.train.ranks import Ranks

    devices = ["cpu", "cpu"] if args.device == "cpu" else ["cuda:0", "cuda:1"]
    ranks = Ranks(launched(), devices, timeout_s=600)
    try:
        return time_steps(args, shard, ranks)
    finally:
        ranks.close()


def two_ranks(args: argparse.Namespace, shard: str) -> list[float]:
    from orbit.train.launcher import call_on_ranks

    return call_on_ranks(2, rank_main, args, shard, run_id=f"bench-{shard}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(ROOT / ".cache/tiny/llama-s0"))
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--prompt", type=int, default=48)
    p.add_argument("--output", type=int, default=96)
    p.add_argument("--micro", type=int, default=0, help="trainer.micro_batch_tokens")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = p.parse_args()
    one = statistics.median(time_steps(args, "none"))
    rows = [("1 rank", one)]
    for name, shard in (("2 ranks", "none"), ("2 ranks, fsdp", "fsdp")):
        rows.append((name, statistics.median(two_ranks(args, shard))))
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    tokens = sum(len(s.output_ids) for s in batch(args.samples, 8, args.prompt, args.output, vocab))
    print(
        f"model {args.model}, {args.samples} samples ({tokens} output tokens), device "
        f"{args.device}, one thread per rank, median of {args.steps} steps"
    )
    print(f"{'':16} {'step s':>8} {'out tok/s':>10} {'speed-up':>9}")
    for name, seconds in rows:
        print(f"{name:16} {seconds:8.3f} {tokens / seconds:10.1f} {one / seconds:8.2f}x")


if __name__ == "__main__":
    main()
