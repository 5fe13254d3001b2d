"""Decode throughput: the embedded engine (client + its own process) vs transformers' `generate`,
and SGLang in-process beside them (`--sglang`).

Same model (the tiny one built offline with orbit.models.tiny, or `--model DIR`, e.g. the imported
SmolLM2), same 64 requests with long-tailed output lengths (lognormal max_new_tokens clipped to [8,
256], ignore_eos so every request runs to its length), same sampling (temperature 1), same torch
thread count. transformers runs static batches: a batch lasts as long as its longest request. Only
useful tokens count for all: each request's own max_new_tokens. First, one decode step at batch B:
the embedded engine's step against transformers' own forward of B tokens over a KV cache (the
engine's cost per step should be no more than the model's).

    .venv/bin/python bench/engine_throughput.py [--arch llama] [--threads 1] [--batch 32] [--repeat
    3] make bench-engine MODEL=.cache/smollm2-135m-instruct          # the real model, with SGLang's
    column
                                                [--device cuda --dtype bfloat16]   # on a GPU
"""

from __future__ import annotations

import argparse
import platform
import random
import tempfile
import time
from pathlib import Path

import torch

from orbit.engine.base import SamplingParams
from orbit.engine.embedded import EngineCore, EngineOptions, start_embedded_engine
from orbit.models.tiny import build_tiny_model


def workload(n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 384) for _ in range(rng.randint(8, 32))] for _ in range(n)]
    lengths = [max(8, min(256, round(rng.lognormvariate(3.5, 0.9)))) for _ in range(n)]
    return prompts, lengths


def run_engine(client, prompts: list[list[int]], lengths: list[int]) -> tuple[int, float]:
    t0 = time.perf_counter()
    futures = [
        client.generate(
            p, SamplingParams(max_new_tokens=n, temperature=1.0, seed=i, ignore_eos=True), slot=None
        )
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    tokens = sum(len(f.result().output_ids) for f in futures)
    return tokens, time.perf_counter() - t0


@torch.no_grad()
def run_transformers(
    model, prompts: list[list[int]], lengths: list[int], batch: int
) -> tuple[int, float]:
    t0 = time.perf_counter()
    useful = 0
    for i in range(0, len(prompts), batch):
        ps, ns = prompts[i : i + batch], lengths[i : i + batch]
        width = max(len(p) for p in ps)
        # left padding for generate
        ids = torch.tensor([[0] * (width - len(p)) + p for p in ps], device=model.device)
        mask = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p in ps], device=model.device
        )
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max(ns),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            pad_token_id=0,
        )
        assert out.shape[1] == width + max(ns), "a batch stopped early: eos must be off"
        useful += sum(ns)  # what the requests asked for; the rest of each row is waste
    return useful, time.perf_counter() - t0


@torch.inference_mode()
def decode_step(
    path: Path, batch: int, device: str, dtype: str, steps: int = 20
) -> tuple[float, float]:
    """Seconds per decode step at `batch` rows of 40-token prompts: the engine's whole step
    (forward, sampling, bookkeeping), and transformers' forward of one token per row over its KV
    cache."""
    from transformers import AutoModelForCausalLM

    core = EngineCore(
        str(path), EngineOptions(max_running=batch, max_context=512, device=device, dtype=dtype)
    )
    prompts = [[5 + i + j for j in range(40)] for i in range(batch)]
    for p in prompts:
        core.submit(
            p, SamplingParams(max_new_tokens=1000, ignore_eos=True, temperature=1.0, seed=1)
        )
    core.step()  # prefill
    core.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        core.step()
    engine_s = (time.perf_counter() - t0) / steps
    del core
    model = (
        AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    )
    out = model(torch.tensor(prompts, device=device), use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = model(token, past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    return engine_s, (time.perf_counter() - t0) / steps


def run_sglang(path: Path, args, prompts, lengths) -> tuple[int, float]:
    from orbit.engine.sglang import start_sglang_engine

    engine = start_sglang_engine(path, max_running=args.batch, threads=args.threads, seed=args.seed)
    try:
        run_engine(engine, prompts[:8], [16] * 8)
        return min(
            (run_engine(engine, prompts, lengths) for _ in range(args.repeat)), key=lambda r: r[1]
        )
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--arch", default="llama", choices=["llama", "qwen2"])
    ap.add_argument(
        "--model", type=Path, default=None, help="a model directory (default: a tiny one, built)"
    )
    ap.add_argument(
        "--sglang", action="store_true", help="SGLang in-process too (needs `make sglang`)"
    )
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument(
        "--batch", type=int, default=32, help="engine max_running and transformers batch size"
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads for each side")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N], for both sides")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument(
        "--repeat", type=int, default=3, help="timed runs per side; the best is reported"
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    prompts, lengths = workload(args.requests, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or build_tiny_model(tmp, arch=args.arch, seed=0)
        name = args.model.name if args.model else f"{args.arch} tiny model"
        engine_step, hf_step = decode_step(path, args.batch, args.device, args.dtype)
        model = (
            AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype))
            .to(args.device)
            .eval()
        )
        model.generation_config.eos_token_id = None  # ignore_eos, as the engine requests do
        client = start_embedded_engine(
            path,
            max_running=args.batch,
            threads=args.threads,
            seed=args.seed,
            dtype=args.dtype,
            device=args.device,
        )
        try:
            run_engine(client, prompts[:8], [16] * 8)  # warm-up both
            run_transformers(model, prompts[:8], [16] * 8, 8)
            eng, hf = [], []
            for _ in range(args.repeat):  # alternate, so machine noise hits both sides alike
                eng.append(run_engine(client, prompts, lengths))
                hf.append(run_transformers(model, prompts, lengths, args.batch))
        finally:
            client.shutdown()
        sgl = run_sglang(path, args, prompts, lengths) if args.sglang else None

    eng_tok, eng_s = min(eng, key=lambda r: r[1])
    hf_tok, hf_s = min(hf, key=lambda r: r[1])
    eng_rate, hf_rate = eng_tok / eng_s, hf_tok / hf_s
    print(
        f"machine: {platform.machine()} {platform.processor() or ''}, {torch.get_num_threads()} "
        f"torch thread(s) per side, torch {torch.__version__}"
    )
    print(
        f"decode step at batch {args.batch}: embedded engine {1000 * engine_step:.1f} ms, "
        f"transformers forward {1000 * hf_step:.1f} ms ({engine_step / hf_step:.2f}x)"
    )
    print(
        f"workload: {args.requests} requests, {name}, output lengths "
        f"{min(lengths)}..{max(lengths)} (mean {sum(lengths) / len(lengths):.0f}), {sum(lengths)} "
        f"useful tokens, batch/max_running {args.batch}"
    )
    print(
        f"embedded engine (client + process): {eng_tok} tokens in {eng_s:.3f} s = {eng_rate:,.0f} "
        "tok/s"
    )
    print(
        f"transformers generate (static):     {hf_tok} tokens in {hf_s:.3f} s = {hf_rate:,.0f} "
        "tok/s"
    )
    if sgl is not None:
        print(
            f"SGLang in-process (CPU):            {sgl[0]} tokens in {sgl[1]:.3f} s = "
            f"{sgl[0] / sgl[1]:,.0f} tok/s"
        )
    print(f"ratio: {eng_rate / hf_rate:.2f}x")


if __name__ == "__main__":
    main()
