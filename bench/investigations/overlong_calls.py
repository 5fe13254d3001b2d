"""What the overlong penalty charged a multi-turn run's episodes: per call (now), summed (before).

Reads a run's samples.jsonl (two prompt groups a step, each sample with its token mask) and
recipe.yaml, and prints, for the episodes of each third of the run: how many made more than one
call, how many were right at a later attempt, and the penalty those right ones took with each call
against its own `max_new_tokens` (orbit/rl/filters.py) and with all calls summed against one call's
limit (the count before). The agent recipe's figures: bench/investigations/learning.md.

    .venv/bin/python bench/investigations/overlong_calls.py runs/smollm2-agent
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import yaml

from orbit import rl
from orbit.rl import AlgorithmConfig

HEAD = (
    "steps | episodes | more than one call | right at a later attempt | "
    "their penalty, per call / summed"
)


def penalties(mask: list[int], cfg: AlgorithmConfig, limit: int) -> tuple[float, float]:
    """The episode's penalty as the run counts it (orbit.rl.shaped_rewards: its longest call's) and
    summed (all its calls as one answer against one call's limit)."""
    per_call = rl.shaped_rewards([0.0], [rl.call_lengths(mask)], cfg, limit)[0]
    return per_call, rl.overlong_penalty(sum(mask), limit, cfg.buffer(limit))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    args = parser.parse_args()
    recipe = yaml.safe_load((args.run / "recipe.yaml").read_text())
    limit = recipe["rollout"]["max_new_tokens"]
    cfg = AlgorithmConfig(overlong="penalty")
    rows = [json.loads(line) for line in (args.run / "samples.jsonl").open()]
    steps = max(r["step"] for r in rows) + 1
    third = (steps + 2) // 3
    print(f"{args.run}: max_new_tokens {limit}, penalty from {limit - cfg.buffer(limit)} tokens")
    print(HEAD)
    for lo in range(0, steps, third):
        part = [r for r in rows if lo <= r["step"] < lo + third]
        many = [r for r in part if len(rl.call_lengths(r["trained"])) > 1]
        later = [r for r in many if r["correct"]]
        charged = [penalties(r["trained"], cfg, limit) for r in later]
        per_call = statistics.fmean(c[0] for c in charged) if charged else 0.0
        summed = statistics.fmean(c[1] for c in charged) if charged else 0.0
        print(
            f"{lo + 1}-{min(lo + third, steps)} | {len(part)} | "
            f"{len(many) / len(part):.0%} | {len(later) / len(part):.0%} | "
            f"{per_call:.2f} / {summed:.2f}"
        )


if __name__ == "__main__":
    main()
