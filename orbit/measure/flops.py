"""A step's physical floor (issue 39): the FLOPs its work needs, at this machine's measured matmul
rate. The useful FLOPs of a step are the trainer's forward and backward through the frozen base for
each trained token (4 x P) and the engine's forward for each generated token (2 x P), P the weights
a token's forward multiplies by: the decoder layers' and the output head's. Recompute, padding,
prompts and LoRA's own matmuls count as overhead, not as work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def matmul_params(model: str | Path) -> int:
    """P for the checkpoint at `model`, from its config alone (built on the meta device: no weights
    read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from orbit.train.measure import matmul_params as of_model

    with torch.device("meta"):
        return of_model(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)))


def matmul_peak(
    threads: int,
    hidden: int = 576,
    inner: int = 1536,
    rows: int = 2048,
    reps: int = 20,
    rounds: int = 5,
) -> float:
    """GFLOP/s of torch.mm [rows, hidden] x [hidden, inner] in float32 on `threads` CPU threads, in
    a fresh process (this one's thread settings and warm caches left alone): the best of `rounds`
    timings of `reps` products. The best, because a peak is what the cores reach: one timing of
    half a second took a neighbour's burst for the machine's rate (90 against 139-172 GFLOP/s on 2
    threads in six runs of bench/investigations/cores.py one after another)."""
    code = (
        f"import time, torch; torch.set_num_threads({threads}); a = torch.randn({rows}, {hidden}); "
        f"b = torch.randn({hidden}, {inner}); [a @ b for _ in range(3)]\n"
        f"best = 0.0\nfor _ in range({rounds}):\n"
        f"    t = time.perf_counter(); [a @ b for _ in range({reps})]\n"
        f"    best = max(best, 2 * {rows} * {hidden} * {inner} * {reps} / "
        "(time.perf_counter() - t) / 1e9)\nprint(best)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def useful_flops(row: dict, params: int) -> float:
    """One metrics line's useful FLOPs: its trained tokens' forward and backward, its generated
    tokens' forward."""
    return (4 * row["trained_tokens"] + 2 * row["tokens_generated"]) * params


def flop_floor_s(rows: list[dict], params: int, peak_gflops: float) -> float:
    """The mean step's floor: its useful FLOPs at the peak, every core at it the whole step."""
    return sum(useful_flops(r, params) for r in rows) / len(rows) / (peak_gflops * 1e9)
