"""The embedded engine on the laptop recipe's own work: tokens/s by rows decoded at once
(`engine.max_running`) and torch threads.

    .venv/bin/python bench/investigations/engine_rows.py [--model .cache/smollm2-135m-instruct]
        [--rows 32,64] [--threads 1,2] [--repeat 3]

64 requests (`--requests`), each the chat-templated "What is A + B?" of the arith task (two-digit
numbers), 32 new tokens each (ignore_eos, so every setting generates the same tokens), temperature
0.7, through the real client and engine process. The first run of a setting prefills the prompts;
the later ones find them in the prefix cache, as a run's groups mostly do (8 samples share a
prompt), so they time decoding. Reported per setting: every run's tokens/s, and the median of the
runs after the first. With 2 cores, run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from transformers import AutoTokenizer

from orbit.engine.base import SamplingParams
from orbit.engine.embedded import start_embedded_engine

NEW_TOKENS = 32


def prompts(model: Path, requests: int) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(model)
    rng = random.Random(0)
    out = []
    for _ in range(requests):
        text = f"What is {rng.randint(10, 99)} + {rng.randint(10, 99)}?"
        chat = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        out.append(tok.encode(chat, add_special_tokens=False))
    return out


def rates(model: Path, rows: int, threads: int, repeat: int, work: list[list[int]]) -> list[float]:
    """tokens/s of each run: all requests submitted at once, timed until the last is done."""
    engine = start_embedded_engine(model, max_running=rows, max_context=512, threads=threads)
    out = []
    try:
        for run in range(repeat):
            sampling = SamplingParams(
                max_new_tokens=NEW_TOKENS, temperature=0.7, seed=run, ignore_eos=True
            )
            t0 = time.perf_counter()
            futures = [engine.generate(p, sampling) for p in work]
            tokens = sum(len(f.result(600).output_ids) for f in futures)
            out.append(tokens / (time.perf_counter() - t0))
    finally:
        engine.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, default=Path(".cache/smollm2-135m-instruct"))
    ap.add_argument("--rows", default="32,64", help="engine.max_running values")
    ap.add_argument("--threads", default="1,2", help="engine torch thread counts")
    ap.add_argument("--repeat", type=int, default=3, help="runs per setting, the first prefills")
    ap.add_argument("--requests", type=int, default=64)
    args = ap.parse_args()
    work = prompts(args.model, args.requests)
    print("| max_running | threads | tokens/s, each run | median after the first |")
    print("|---|---|---|---|")
    for rows in [int(r) for r in args.rows.split(",")]:
        for threads in [int(t) for t in args.threads.split(",")]:
            r = rates(args.model, rows, threads, args.repeat, work)
            later = statistics.median(r[1:]) if len(r) > 1 else r[0]
            each = " / ".join(f"{x:.0f}" for x in r)
            print(f"| {rows} | {threads} | {each} | **{later:.0f}** |", flush=True)


if __name__ == "__main__":  # the engine's process is spawned: it imports this module again
    main()
