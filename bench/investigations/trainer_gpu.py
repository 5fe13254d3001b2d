"""A laptop-sized trainer step on a CUDA GPU: where a small model's step goes there (issue 39).

A model of SmolLM2-135M's shape (its config and tokenizer; random weights, so that the checkpoint
need not be on the GPU machine) trains by Orbit's Trainer in bf16 and in fp32 on batches of the
math recipe's shape (4 groups of 8, 40-token prompts, 12-36 trained tokens each). It prints the step
time, the useful rate as issue 39 counts it (4 x matmul weights x trained tokens per second) against
torch.mm's rate on the model's shapes in the same dtype, and with --profile one step under
torch.profiler: the GPU's kernel time against the step's wall time and the kernel launches.

    python bench/investigations/trainer_gpu.py [--model .cache/smollm2-135m-instruct] [--steps 10]
        [--profile] [--compile]    # --compile: each dtype also with compile_layers: step, warm-up,
                                   # logprob agreement
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from orbit.config import AdapterConfig, TrainerConfig
from orbit.measure.flops import matmul_params
from orbit.rollout.sample import Sample
from orbit.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def random_model(source: Path, out: Path) -> Path:
    """`source`'s config and tokenizer with random weights, saved at `out`."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source)).save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out


def mm_peak(
    dtype: torch.dtype, hidden: int, inner: int, rows: int = 2048, reps: int = 200
) -> float:
    """FLOP/s of torch.mm [rows, hidden] x [hidden, inner] on the GPU."""
    a = torch.randn(rows, hidden, device="cuda", dtype=dtype)
    b = torch.randn(hidden, inner, device="cuda", dtype=dtype)
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * rows * hidden * inner * reps / (time.perf_counter() - t)


def compile_layers(trainer: Trainer) -> None:
    """Compile each decoder layer's MLP in place (torch.compile's regional compilation: one graph
    serves every layer, for any number of tokens). Not the whole layer: its attention reads the
    prompts' keys and values, whose strides differ from pass to pass, and each new stride
    recompiles until torch gives up and runs it eagerly (32 recompiles in 3 steps on a GPU). The
    MLP runs in a few variants (grad on or off, inputs that need grad or not): a few more than
    torch's default limit of 8 are allowed, so that none falls back to eager."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 16)
    for layer in trainer._decoder.layers:
        layer.mlp.compile(dynamic=True)


def batch(rng: random.Random, vocab: int, groups: int = 4, size: int = 8) -> list[Sample]:
    """The math recipe's shape: `groups` prompts of 40 tokens, `size` completions of 12-36."""
    out = []
    for g in range(groups):
        prompt = [rng.randrange(100, vocab) for _ in range(40)]
        for _ in range(size):
            n = rng.randint(12, 36)
            out.append(
                Sample(
                    prompt,
                    [rng.randrange(100, vocab) for _ in range(n)],
                    [-1.0] * n,
                    rng.random(),
                    0,
                    0,
                    loss_mask=[1] * n,
                    advantage=rng.gauss(0.0, 1.0),
                    group_id=g,
                )
            )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, default=ROOT / ".cache" / "smollm2-135m-instruct")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--compile", action="store_true", help="also each dtype with its MLPs compiled")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    cfg = AutoConfig.from_pretrained(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        model = random_model(args.model, Path(tmp) / "model")
        params = matmul_params(model)
        probe = batch(random.Random(1), cfg.vocab_size)  # the same batch scored by every trainer
        for dtype in args.dtypes.split(","):
            peak = mm_peak(getattr(torch, dtype), cfg.hidden_size, cfg.intermediate_size)
            eager: list[list[float]] = []
            for compiled in (False, True) if args.compile else (False,):
                trainer = Trainer(
                    model,
                    AdapterConfig(r=16, alpha=32, target_modules=TARGETS),
                    TrainerConfig(device="cuda", dtype=dtype, micro_batch_tokens=2048, lr=3e-4),
                    temperature=0.7,
                    seed=0,
                )
                if compiled:
                    compile_layers(trainer)
                t = time.perf_counter()
                logprobs = trainer.logprobs(probe)  # the same adapter init: the same logprobs
                rng = random.Random(0)
                for _ in range(3):  # warm-up: allocator, kernels' first launches, the compile
                    trainer.step(batch(rng, cfg.vocab_size))
                warm = time.perf_counter() - t
                times, tokens = [], 0
                for _ in range(args.steps):
                    b = batch(rng, cfg.vocab_size)
                    tokens += sum(len(s.output_ids) for s in b)
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    trainer.step(b)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t)
                useful = 4 * params * tokens / sum(times)
                agree = ""
                if compiled:
                    pairs = zip(eager, logprobs, strict=True)
                    diff = max(abs(a - b) for x, y in pairs for a, b in zip(x, y, strict=True))
                    agree = f", logprobs vs eager max |diff| {diff:.1e}"
                eager = logprobs
                print(
                    f"{torch.cuda.get_device_name()} {dtype}{' compiled' if compiled else ''}: "
                    f"step {1e3 * sum(times) / len(times):.0f} ms (fastest "
                    f"{1e3 * min(times):.0f}), {tokens / len(times):.0f} trained tokens, useful "
                    f"{useful / 1e12:.2f} TFLOP/s of torch.mm's {peak / 1e12:.1f}: "
                    f"{useful / peak:.4f}; warm-up {warm:.1f} s{agree}",
                    flush=True,
                )
                if args.profile:
                    profile_step(trainer, batch(rng, cfg.vocab_size))
                trainer.close()


def profile_step(trainer: Trainer, samples: list[Sample]) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        trainer.step(samples)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    events = prof.key_averages()
    gpu_s = sum(e.self_device_time_total for e in events) / 1e6
    launches = sum(e.count for e in events if "LaunchKernel" in e.key)
    print(
        f"  one step profiled: {wall * 1e3:.0f} ms, GPU kernels {gpu_s * 1e3:.0f} ms "
        f"({gpu_s / wall:.0%} of it), {launches:,} kernel launches",
        flush=True,
    )


if __name__ == "__main__":
    main()
