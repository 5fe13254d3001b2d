"""Decode throughput, start time and push time: the embedded engine, SGLang in-process
(`engine.backend: sglang`) and an SGLang server over HTTP (`engine.backend: sglang-server`), side by
side.

Same tiny model (built offline with orbit.models.tiny), same workload as bench/engine_throughput.py
(64 requests, prompts of 8-32 tokens, long-tailed output lengths lognormal(3.5, 0.9) clipped to
[8, 256], ignore_eos, temperature 1), both driven through Orbit's Engine protocol (`generate`
futures) the way the rollout producer drives them, same max_running, one torch thread for each
engine's compute process. Two rows: base model (slot None), and every request on a LoRA slot
(r=8 on q, k, v, o, random weights), which is what rollouts run on. Runs alternate between the
engines and the best of `--repeat` is reported. Push: a LoRA load into an idle slot (what the
double-buffer push does before its flip), median of 10.

    .venv/bin/python bench/sglang_vs_embedded.py [--arch llama] [--batch 32] [--repeat 3]

Needs sglang installed in the venv (`make sglang`).
"""

from __future__ import annotations

import argparse
import platform
import random
import tempfile
import time

import torch

from orbit.engine.base import SamplingParams


def workload(n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 384) for _ in range(rng.randint(8, 32))] for _ in range(n)]
    lengths = [max(8, min(256, round(rng.lognormvariate(3.5, 0.9)))) for _ in range(n)]
    return prompts, lengths


def run(engine, prompts: list[list[int]], lengths: list[int], slot) -> tuple[int, float]:
    t0 = time.perf_counter()
    futures = [
        engine.generate(
            p, SamplingParams(max_new_tokens=n, temperature=1.0, seed=i, ignore_eos=True), slot=slot
        )
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    tokens = sum(len(f.result().output_ids) for f in futures)
    return tokens, time.perf_counter() - t0


def random_lora(path, r: int = 8) -> tuple[dict, dict]:
    import peft
    from transformers import AutoModelForCausalLM

    from orbit.train.peft_adapter import adapter_config_dict, adapter_tensors

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = peft.get_peft_model(
        base,
        peft.LoraConfig(
            r=r, lora_alpha=2 * r, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
        ),
    )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return adapter_tensors(model), adapter_config_dict(model)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--arch", default="llama", choices=["llama", "qwen2"])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32, help="max_running of both engines")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads of each engine's compute process"
    )
    ap.add_argument(
        "--repeat", type=int, default=3, help="timed runs per engine and row; the best is reported"
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from orbit.engine.embedded import start_embedded_engine
    from orbit.engine.sglang import start_sglang_engine
    from orbit.engine.sglang.process import SGLangOptions
    from orbit.engine.sglang.server import start_server_engine
    from orbit.models.tiny import build_tiny_model

    torch.set_num_threads(1)
    prompts, lengths = workload(args.requests, args.seed)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj")
    rows, starts, pushes, engines = {}, {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(tmp, arch=args.arch, seed=0)
        tensors, config = random_lora(path)
        starters = {
            "embedded": lambda: start_embedded_engine(
                path, max_running=args.batch, threads=args.threads, seed=args.seed
            ),
            "sglang": lambda: start_sglang_engine(
                path,
                max_running=args.batch,
                threads=args.threads,
                seed=args.seed,
                max_lora_rank=8,
                lora_target_modules=targets,
            ),
            "sglang-server": lambda: start_server_engine(
                path,
                SGLangOptions(
                    max_running=args.batch,
                    threads=args.threads,
                    seed=args.seed,
                    max_lora_rank=8,
                    lora_target_modules=targets,
                ),
                threads=args.threads,
            ),
        }
        try:
            for name, start in starters.items():
                t0 = time.perf_counter()
                engines[name] = start()
                starts[name] = time.perf_counter() - t0
            for name, eng in engines.items():
                pushes[name] = push_time(eng, tensors, config)
                run(eng, prompts[:8], [16] * 8, 0)  # warm-up
            for label, slot in (("base model", None), ("LoRA slot (r=8, q/k/v/o)", 0)):
                results: dict[str, list[tuple[int, float]]] = {name: [] for name in engines}
                for _ in range(args.repeat):  # alternate, so machine noise hits all alike
                    for name, eng in engines.items():
                        results[name].append(run(eng, prompts, lengths, slot))
                rows[label] = {k: min(v, key=lambda r: r[1]) for k, v in results.items()}
        finally:
            for eng in engines.values():
                eng.shutdown()

    import sglang as sgl

    print(
        f"machine: {platform.machine()} {platform.processor() or ''}, CPU only, torch "
        f"{torch.__version__}, sglang {sgl.__version__}, {args.threads} torch thread(s) per engine"
    )
    print(
        f"workload: {args.requests} requests, {args.arch} tiny model, output lengths "
        f"{min(lengths)}..{max(lengths)} (mean {sum(lengths) / len(lengths):.0f}), {sum(lengths)} "
        f"tokens, max_running {args.batch}, best of {args.repeat}"
    )
    names = list(engines)
    print(f"{'':28s}" + "".join(f"{n:>26s}" for n in names))
    for label, r in rows.items():
        print(
            f"{label:28s}"
            + "".join(f"{r[n][0] / r[n][1]:>12,.0f} tok/s ({r[n][1]:5.2f} s)" for n in names)
        )
    print(f"{'engine start':28s}" + "".join(f"{starts[n]:>24.1f} s" for n in names))
    print(
        f"{'LoRA load into an idle slot':28s}"
        + "".join(f"{pushes[n] * 1000:>23.1f} ms" for n in names)
    )


def push_time(engine, tensors: dict, config: dict, n: int = 10) -> float:
    """Median time of a LoRA load into an idle slot (slot 1; slot 0 keeps the adapter the runs
    use)."""
    from statistics import median

    engine.load_adapter(0, tensors, config, 1)
    times = []
    for version in range(2, 2 + n):
        t0 = time.perf_counter()
        engine.load_adapter(1, tensors, config, version)
        times.append(time.perf_counter() - t0)
    return median(times)


if __name__ == "__main__":
    main()
