"""No idle core: the laptop recipe with the trainer borrowing the idle engines' cores
(`trainer.borrow_cores`) and the embedded engine the waiting trainer's (`engine.borrow_cores`), and
without, side by side in one script, on each engine; and the trainer's achieved FLOP rate against
this machine's measured matmul peak.

    .venv/bin/python bench/investigations/cores.py [--recipe recipes/smollm2-math.yaml] [--steps 20]
    [--engines embedded,sglang] [--settings off,on] [--seeds 0,1,2]

Per engine and setting (off; on: the trainer borrows the idle engines' cores and the embedded
engine the waiting trainer's; trainer-only: the first without the second; on-passive: on with
OMP_WAIT_POLICY=passive, idle OpenMP workers sleeping at once instead of spinning): the median
step (steps past the first 2), the engines' tokens per second while they generate (Σ tokens / Σ busy
seconds: borrowing must not slow generation by more than 10%), the share of the trainer's thread
checks that borrowed, and the trainer's TFLOP/s
(metrics.jsonl's trainer_tflops: its matmul FLOPs over train_s), and its useful rate as issue 39
counts it (4 x parameters x trained tokens over train_s). The matmul peak is torch.mm on
float32 matrices of the model's shapes, on 1 and on 2 threads, the best of 5 timings. With several
`--seeds` each seed's settings run one after another (the recipe's `seed` set to it), and
OUT/table.md gives the median over the seeds, the range in brackets, and each engine's on/off
ratios (median of the seeds' own).
With 2 cores, run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # seeds.py, in bench/ beside this folder
from seeds import spread  # noqa: E402

from orbit.measure.flops import matmul_params, matmul_peak  # noqa: E402

# setting: (trainer.borrow_cores, engine.borrow_cores, environment)
SETTINGS = {
    "off": (False, False, {}),
    "on": (True, True, {}),
    "trainer-only": (True, False, {}),  # before the engines borrowed the waiting trainer's cores
    "on-passive": (True, True, {"OMP_WAIT_POLICY": "PASSIVE"}),  # idle OpenMP workers sleep
}


def run(args: argparse.Namespace, engine: str, setting: str, seed: int) -> dict:
    borrow, lend, env = SETTINGS[setting]
    data = yaml.safe_load(args.recipe.read_text())
    data["trainer"].update({"borrow_cores": borrow, "steps": args.steps, "save_every": 10_000})
    data["engine"]["backend"] = engine
    if engine == "embedded":  # SGLang's threads are fixed when it starts: it has no such field
        data["engine"]["borrow_cores"] = lend
    data["seed"] = seed
    out = args.out / f"{engine}-{setting}-seed{seed}"
    data["out"] = str(out)
    path = args.out / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    subprocess.run(
        [sys.executable, "-m", "orbit.cli", "train", str(path), "--quiet"],
        cwd=ROOT,
        check=True,
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][2:]
    busy = sum(r["engine_busy_s"] for r in rows)
    return {
        "step_s": statistics.median(r["step_s"] for r in rows),
        "engine_tok_per_busy_s": sum(r["tokens_generated"] for r in rows) / busy
        if busy
        else float("nan"),
        "borrowed": statistics.fmean(r["borrowed_frac"] for r in rows),
        "trainer_tflops": statistics.median(r["trainer_tflops"] for r in rows),
        "train_s": statistics.median(r["train_s"] for r in rows),
        # a run's steps train different token counts (what the engines made, and when): per
        # token is the like-for-like figure between settings
        "train_ms_per_token": 1e3
        * sum(r["train_s"] for r in rows)
        / sum(r["trained_tokens"] for r in rows),
        # issue 39's measure: forward and backward through the frozen base, 4 x parameters a
        # trained token; recompute, padding and prompts are not counted
        "useful_gflops": 4
        * matmul_params(ROOT / data["model"])
        * sum(r["trained_tokens"] for r in rows)
        / sum(r["train_s"] for r in rows)
        / 1e9,
    }


FIGURES = (  # (key, column, format)
    ("step_s", "step (s)", "{:.2f}"),
    ("train_s", "train (s)", "{:.2f}"),
    ("train_ms_per_token", "train ms / trained token", "{:.1f}"),
    ("engine_tok_per_busy_s", "engine tok/s while generating", "{:.0f}"),
    ("borrowed", "borrowed", "{:.0%}"),
    ("useful_gflops", "useful GFLOP/s", "{:.1f}"),
)


def table(results: dict, engines: list[str], settings: list[str], seeds: list[int]) -> str:
    """Per engine and setting, each figure's median over the seeds; per engine, the seeds' own
    on/off ratios of the step and of the train time per trained token, their median."""
    runs, peak = results["runs"], results["peak_gflops"][2]
    head = (
        "| engine | setting | "
        + " | ".join(c for _, c, _ in FIGURES)
        + " | useful / 2-thread peak |"
    )
    lines = [head, "|" + "---|" * (len(FIGURES) + 3)]
    for engine in engines:
        for setting in settings:
            rs = [runs[f"{engine}/{setting}/{seed}"] for seed in seeds]
            cells = [spread([r[k] for r in rs], fmt) for k, _, fmt in FIGURES]
            useful = spread([r["useful_gflops"] / peak for r in rs], "{:.2f}")
            lines.append(f"| {engine} | {setting} | " + " | ".join(cells) + f" | {useful} |")
    if "off" in settings and "on" in settings:
        lines += ["", "| engine | step on/off | train per token on/off |", "|---|---|---|"]
        for engine in engines:
            ratio = {
                k: [
                    runs[f"{engine}/on/{seed}"][k] / runs[f"{engine}/off/{seed}"][k]
                    for seed in seeds
                ]
                for k in ("step_s", "train_ms_per_token")
            }
            lines.append(
                f"| {engine} | {spread(ratio['step_s'], '{:.3f}×')} | "
                f"{spread(ratio['train_ms_per_token'], '{:.3f}×')} |"
            )
    seeds_text = ", ".join(map(str, seeds))
    return (
        f"Seeds {seeds_text}; matmul peak {results['peak_gflops'][1]:.1f} GFLOP/s on 1 thread, "
        f"{peak:.1f} on 2.\n\n" + "\n".join(lines) + "\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", type=Path, default=Path("recipes/smollm2-math.yaml"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--engines", default="embedded,sglang")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="of: " + ", ".join(SETTINGS))
    parser.add_argument("--seeds", default="0", help="comma-separated; each runs every setting")
    parser.add_argument("--out", type=Path, default=Path("runs/bench-cores"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    engines, settings = args.engines.split(","), args.settings.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    peak = {n: matmul_peak(n) for n in (1, 2)}
    print(
        f"matmul peak, float32: {peak[1]:.1f} GFLOP/s on 1 thread, {peak[2]:.1f} on 2", flush=True
    )
    results: dict = {"peak_gflops": peak, "runs": {}}
    for seed in seeds:
        for engine in engines:
            for setting in settings:
                t0 = time.time()
                r = run(args, engine, setting, seed)
                results["runs"][f"{engine}/{setting}/{seed}"] = r
                print(
                    f"seed {seed} {engine:9s} {setting:12s} step {r['step_s']:.2f} s (train "
                    f"{r['train_s']:.2f} s), engine {r['engine_tok_per_busy_s']:.0f} tok/s while "
                    f"busy, borrowed {r['borrowed']:.0%}, trainer "
                    f"{r['trainer_tflops'] * 1e3:.1f} GFLOP/s = "
                    f"{r['trainer_tflops'] * 1e3 / peak[2]:.0%} of the 2-thread peak; useful "
                    f"{r['useful_gflops']:.1f} GFLOP/s = {r['useful_gflops'] / peak[2]:.2f} of it "
                    f"({time.time() - t0:.0f} s)",
                    flush=True,
                )
            (args.out / "summary.json").write_text(json.dumps(results, indent=1))
    text = table(results, engines, settings, seeds)
    (args.out / "table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
