"""No idle core while the trainer is the bottleneck: the laptop recipe with the trainer borrowing
the idle engines' cores (`trainer.borrow_cores`) and without, side by side in one script, on each
engine; and the trainer's achieved FLOP rate against this machine's measured matmul peak.

    .venv/bin/python bench/cores.py [--recipe recipes/smollm2-math.yaml] [--steps 20] [--engines
    embedded,sglang]

Per engine and setting (off; on; on with OMP_WAIT_POLICY=passive, idle OpenMP workers sleeping at
once instead of spinning): the median step (steps past the first 2), the engines' tokens per second
while they generate (Σ tokens / Σ busy seconds: borrowing must not slow generation by more than
10%), the share of the trainer's thread checks that borrowed, and the trainer's TFLOP/s
(metrics.jsonl's trainer_tflops: its matmul FLOPs over train_s), and its useful rate as issue 39
counts it (4 x parameters x trained tokens over train_s). The matmul peak is torch.mm on
float32 matrices of the model's shapes, on 1 and on 2 threads. With 2 cores, run nothing else
meanwhile.
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

from orbit.measure.flops import matmul_params, matmul_peak

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {
    "off": (False, {}),
    "on": (True, {}),
    "on, passive OpenMP": (True, {"OMP_WAIT_POLICY": "PASSIVE"}),
}


def run(args: argparse.Namespace, engine: str, setting: str) -> dict:
    borrow, env = SETTINGS[setting]
    data = yaml.safe_load(args.recipe.read_text())
    data["trainer"].update({"borrow_cores": borrow, "steps": args.steps, "save_every": 10_000})
    data["engine"]["backend"] = engine
    out = args.out / f"{engine}-{setting.replace(', ', '-').replace(' ', '-')}"
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
        # issue 39's measure: forward and backward through the frozen base, 4 x parameters a
        # trained token; recompute, padding and prompts are not counted
        "useful_gflops": 4
        * matmul_params(ROOT / data["model"])
        * sum(r["trained_tokens"] for r in rows)
        / sum(r["train_s"] for r in rows)
        / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", type=Path, default=Path("recipes/smollm2-math.yaml"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--engines", default="embedded,sglang")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="of: " + ", ".join(SETTINGS))
    parser.add_argument("--out", type=Path, default=Path("runs/bench-cores"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    peak = {n: matmul_peak(n) for n in (1, 2)}
    print(
        f"matmul peak, float32: {peak[1]:.1f} GFLOP/s on 1 thread, {peak[2]:.1f} on 2", flush=True
    )
    results: dict = {"peak_gflops": peak, "runs": {}}
    for engine in args.engines.split(","):
        for setting in args.settings.split(","):
            t0 = time.time()
            r = results["runs"][f"{engine}/{setting}"] = run(args, engine, setting)
            print(
                f"{engine:9s} {setting:20s} step {r['step_s']:.2f} s (train {r['train_s']:.2f} s), "
                f"engine {r['engine_tok_per_busy_s']:.0f} tok/s while busy, borrowed "
                f"{r['borrowed']:.0%}, trainer {r['trainer_tflops'] * 1e3:.1f} GFLOP/s = "
                f"{r['trainer_tflops'] * 1e3 / peak[2]:.0%} of the 2-thread peak; useful "
                f"{r['useful_gflops']:.1f} GFLOP/s = {r['useful_gflops'] / peak[2]:.2f} of it "
                f"({time.time() - t0:.0f} s)",
                flush=True,
            )
        off, on = results["runs"][f"{engine}/off"], results["runs"][f"{engine}/on"]
        print(
            f"{engine}: step on/off {on['step_s'] / off['step_s']:.3f}x, engine tok/s while busy "
            f"on/off {on['engine_tok_per_busy_s'] / off['engine_tok_per_busy_s']:.3f}x",
            flush=True,
        )
    (args.out / "summary.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
