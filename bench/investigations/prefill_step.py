"""The embedded engine's prefill step size (`max_prefill_tokens`): throughput and the longest step.

A step admits prompts up to max_prefill_tokens. Steps were once also cut to about a second of
prefill, so that the pool's liveness ping (answered only between steps) would not call a long
prefill hung; since the heartbeat (orbit/engine/liveness.py) a long step is never taken for a hang,
and what is left to weigh is throughput against the longest step, which a pause for a flip waits
for. This runs the laptop workload (SmolLM2, 4 chat prompts a wave, 8 samples each, 32 new tokens
at temperature 0.7, waves one after another) on the engine core in this process under each setting,
interleaved, and prints tokens/s and the longest step.

    .venv/bin/python bench/investigations/prefill_step.py [--model .cache/smollm2-135m-instruct]
    [--settings 256,512,4096] [--waves 4] [--repeat 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from orbit.engine.base import SamplingParams
from orbit.engine.embedded import EngineCore, EngineOptions

QUESTIONS = [
    "What is {a} + {b}? Give the number.",
    "Compute {a} times {b}, then subtract {b}.",
    "A shop sells {a} apples on Monday and {b} on Tuesday. How many in all?",
    "What is {a} minus {b}? Show your steps briefly.",
]


def waves(tokenizer, n: int) -> list[list[list[int]]]:
    out = []
    for w in range(n):
        prompts = []
        for i, q in enumerate(QUESTIONS):
            text = q.format(a=17 + 13 * w + i, b=29 + 7 * i)
            chat = [{"role": "user", "content": text}]
            prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            prompts.append(tokenizer.encode(prompt, add_special_tokens=False))
        out.append(prompts)
    return out


def run(core: EngineCore, wave_prompts: list[list[list[int]]]) -> dict:
    sampling = SamplingParams(max_new_tokens=32, temperature=0.7)
    tokens, longest, t0 = 0, 0.0, time.perf_counter()
    for prompts in wave_prompts:
        for p in prompts:
            for _ in range(8):
                core.submit(p, sampling)
        while core.has_work():
            s0 = time.perf_counter()
            core.step()
            longest = max(longest, time.perf_counter() - s0)
            tokens += sum(len(c.output_ids) for _, c in core.pop_finished())
    wall = time.perf_counter() - t0
    return {"tok_s": tokens / wall, "longest_s": longest}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=Path(".cache/smollm2-135m-instruct"))
    ap.add_argument("--settings", default="256,512,4096")
    ap.add_argument("--waves", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    settings = [int(s) for s in args.settings.split(",")]
    results: dict[int, list[dict]] = {s: [] for s in settings}
    for r in range(args.repeat):
        for s in settings:
            # a fresh core each time: its prefix cache and its timed prefill rate start alike
            options = EngineOptions(max_running=32, max_context=512, max_prefill_tokens=s, seed=r)
            core = EngineCore(str(args.model), options)
            results[s].append(run(core, waves(tokenizer, args.waves)))
            del core
    print(f"{args.model.name}, {args.threads} thread(s), {args.waves} waves of 32, {args.repeat}x")
    print("| max_prefill_tokens | tokens/s | longest step (s) |")
    print("|---|---|---|")
    for s, rows in results.items():
        tok = statistics.median(x["tok_s"] for x in rows)
        longest = max(x["longest_s"] for x in rows)
        print(f"| {s} | {tok:.1f} | {longest:.2f} |")


if __name__ == "__main__":
    main()
