"""A sweep of K adapters at once, its runs' steps packed (one forward/backward over the base for
every run ready: orbit/train/packed.py) and turn by turn (`trainer.pack: false`), against the same K
runs one after another, side by side in one script.

The workload is recipes/tiny.yaml (double-buffer, one embedded engine, the tiny model) with a
learning-rate sweep (`--lrs`, K = 4 by default). Measured:
- wall time: `orbit sweep` of the K runs (engine and trainer started once) against the sum of the K
  single runs
  (each `orbit train`, its own engine and trainer), every one from start to its last checkpoint;
- engine utilisation: the engine's busy time (generating) over the wall time, for the sweep and each
  run alone;
- the trainer: tokens trained a second summed over runs, each step's time (p50, p99), the runs a
  pack held, its useful FLOP rate against this machine's measured matmul peak, and the peak memory;
- each adapter's final reward (mean reward of its last 8 steps) in the sweep against its run alone,
  and against
  the same run alone with another seed: the noise a second seed gives, the yardstick for "the same
  adapter".

    .venv/bin/python bench/sweep.py [--lrs 0.005,0.01,0.02,0.04] [--steps 30] [--backend embedded]
        [--runs-only] [--one-seed] [--model PATH] [--device cpu|cuda:0]

`--runs-only` measures the two sweeps only (no runs alone): e.g. with 1, 2, 4, 8 and 16 `--lrs`.
`--one-seed` leaves out the runs alone with a second seed. `--device cuda:0` puts the trainer and
the engine (bf16) on that GPU (scripts/gpu/check.py's `sweep` step, on its own model: `--model`),
and measures no CPU peak.

It prints a table and writes runs/bench-sweep/summary.json. With 2 cores, run nothing else
meanwhile.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from statistics import fmean

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def recipe_data(args: argparse.Namespace, out: Path) -> dict:
    import yaml

    data = yaml.safe_load((ROOT / "recipes" / "tiny.yaml").read_text())
    data["model"] = str(args.model or ROOT / data["model"])
    # room for every run
    data["engine"].update({"backend": args.backend, "max_running": 32 * len(args.lrs)})
    if args.device != "cpu":
        data["engine"].update(device=args.device, dtype="bfloat16")
        data["trainer"]["device"] = args.device
    data["trainer"].update({"steps": args.steps, "save_every": args.steps})
    data["rollout"]["max_new_tokens"] = args.max_new_tokens
    data["out"] = str(out)
    return data


def final_reward(run_dir: Path) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return fmean(r["reward_mean"] for r in rows[-8:])


def total(run_dir: Path, metric: str) -> float:
    """`metric` summed over the run's steps (`engine_busy_s`: the engine's busy seconds; `train_s`,
    `step_s`)."""
    return sum(
        json.loads(line)[metric] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    )


def solo(args: argparse.Namespace, out: Path, lr: float, seed: int) -> tuple[float, Path]:
    from orbit.config import parse_recipe
    from orbit.run.lifecycle import train
    from orbit.run.preflight import preflight

    data = recipe_data(args, out)
    data["trainer"]["lr"], data["seed"] = lr, seed
    t0 = time.perf_counter()
    train(preflight(parse_recipe(data)), live=False)
    return time.perf_counter() - t0, out


def swept(args: argparse.Namespace, out: Path, pack: bool):
    import yaml

    from orbit.measure.memory import PeakRss
    from orbit.sweep.plan import plan_sweep, preflight_sweep
    from orbit.sweep.run import sweep

    data = recipe_data(args, out)
    data["trainer"]["pack"] = pack
    data["runs"] = [{"name": f"lr={lr:g}", "trainer": {"lr": lr}} for lr in args.lrs]
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(data))
    t0 = time.perf_counter()
    with PeakRss() as rss:
        result = sweep(preflight_sweep(plan_sweep(path, []))[0], live=False)
    return time.perf_counter() - t0, result, rss.peak


def trainer_figures(
    result, wall_s: float, params: int, peak_gflops: float | None, rss: int
) -> dict:
    """The sweep's trainer: tokens trained a second over all runs, step times, packs, FLOP rate."""
    from statistics import quantiles

    rows = [
        json.loads(line)
        for s in result.statuses
        for line in (s.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    tokens = sum(r["trained_tokens"] for r in rows)
    train = sorted(r["train_s"] for r in rows)
    q = quantiles(train, n=100, method="inclusive")
    return {
        "tokens_s": tokens / wall_s,
        "step_p50": q[49],
        "step_p99": q[98],
        "packed": fmean(r.get("trainer_packed", 1) for r in rows),
        "useful_gflops": 4 * params * tokens / wall_s / 1e9,
        "of_peak": 4 * params * tokens / wall_s / 1e9 / peak_gflops if peak_gflops else None,
        "peak_rss_mib": rss / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--lrs", default="0.005,0.01,0.02,0.04", type=lambda s: [float(x) for x in s.split(",")]
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--max-new-tokens", type=int, default=24, help="rollout.max_new_tokens (tiny.yaml: 24)"
    )
    parser.add_argument("--backend", default="embedded", choices=["embedded", "sglang"])
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-sweep")
    parser.add_argument("--runs-only", action="store_true", help="the two sweeps, no runs alone")
    parser.add_argument("--one-seed", action="store_true", help="no runs alone with seed 1")
    parser.add_argument("--model", type=Path, default=None, help="default: tiny.yaml's")
    parser.add_argument("--device", default="cpu", help="the trainer's and the engine's")
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)

    from orbit.measure.flops import matmul_params, matmul_peak

    params = matmul_params(recipe_data(args, args.out)["model"])
    peak = matmul_peak(1) if args.device == "cpu" else None
    # a short sweep first: whichever sweep ran first would pay the process's first start-ups
    warm = argparse.Namespace(**{**vars(args), "steps": 2, "lrs": args.lrs[:2]})
    swept(warm, args.out / "warm-up", True)
    sweeps = {}
    for name, pack in (("packed", True), ("turns", False)):
        wall, res, rss = swept(args, args.out / f"sweep-{name}", pack)
        sweeps[name] = (wall, res, trainer_figures(res, wall, params, peak, rss))
    model = "tiny model" if args.model is None else str(args.model)
    print(f"\n{len(args.lrs)} runs × {args.steps} steps, {args.backend} engine, {model}")
    print("| sweep | wall s | tokens trained/s | step p50 / p99 s | runs a pack | useful GFLOP/s "
          "(of 1-thread peak) | peak RSS MiB |\n|---|---|---|---|---|---|---|")  # fmt: skip
    for name, (wall, _, f) in sweeps.items():
        print(
            f"| {name} | {wall:.1f} | {f['tokens_s']:.0f} | {f['step_p50']:.3f} / "
            f"{f['step_p99']:.3f} | {f['packed']:.2f} | {f['useful_gflops']:.2f} "
            f"({'-' if f['of_peak'] is None else format(f['of_peak'], '.3f')}) | "
            f"{f['peak_rss_mib']:.0f} |"
        )
    packed_s, turns_s = sweeps["packed"][0], sweeps["turns"][0]
    print(
        f"packed / turns: wall {packed_s / turns_s:.2f}, tokens trained/s "
        f"{sweeps['packed'][2]['tokens_s'] / sweeps['turns'][2]['tokens_s']:.2f}"
    )
    # the two sweeps' figures now: the runs alone below may not finish (a device command's limit)
    (args.out / "summary.json").write_text(
        json.dumps({k: {"wall_s": v[0], **v[2]} for k, v in sweeps.items()}, indent=1)
    )
    if args.runs_only:
        return
    sweep_s, result, _ = sweeps["packed"]
    alone, second = [], []
    for lr in args.lrs:
        alone.append(solo(args, args.out / f"alone-lr={lr:g}", lr, seed=0))
        if not args.one_seed:
            second.append(solo(args, args.out / f"alone-seed1-lr={lr:g}", lr, seed=1))
    alone_s = sum(s for s, _ in alone)
    alone_busy = sum(total(d, "engine_busy_s") for _, d in alone) / alone_s
    # What no sweep can beat here: one start-up (the sweep's wall time outside its runs' steps),
    # then the runs' generating and training (the single runs' own busy seconds), each on one core,
    # fully overlapped.
    startup_s = sweep_s - max(total(s.run_dir, "step_s") for s in result.statuses)
    work = {
        "engine": sum(total(d, "engine_busy_s") for _, d in alone),
        "trainer": sum(total(d, "train_s") for _, d in alone),
    }
    floor_s = startup_s + max(work.values())

    rows = []
    seconds = second or [None] * len(alone)
    for lr, status, (_, one), two in zip(args.lrs, result.statuses, alone, seconds, strict=True):
        rows.append(
            {
                "lr": lr,
                "state": status.state,
                "sweep": final_reward(status.run_dir),
                "alone": final_reward(one),
                "alone_seed1": final_reward(two[1]) if two else None,
            }
        )
    summary = {
        "runs": len(args.lrs),
        "steps": args.steps,
        "backend": args.backend,
        "sweep_s": sweep_s,
        "turns_s": turns_s,
        "trainer": {k: v[2] for k, v in sweeps.items()},
        "alone_s": alone_s,
        "ratio": sweep_s / alone_s,
        "engine_busy_sweep": result.engine_busy_frac,
        "engine_busy_alone": alone_busy,
        "startup_s": startup_s,
        "work_s": work,
        "floor_s": floor_s,
        "rewards": rows,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))

    print(
        f"\n  sweep (one engine, one trainer):     {sweep_s:7.1f} s, engine busy "
        f"{result.engine_busy_frac:.0%}"
    )
    print(f"  the same runs one after another:     {alone_s:7.1f} s, engine busy {alone_busy:.0%}")
    print(f"  sweep / one after another:           {sweep_s / alone_s:7.2f}x (goal <= 0.5x)")
    print(f"  sweep turn by turn / one after another: {turns_s / alone_s:7.2f}x")
    print(
        f"  floor: one start-up {startup_s:.1f} s + max(generating {work['engine']:.1f} s, "
        f"training {work['trainer']:.1f} s) = {floor_s:.1f} s, {floor_s / alone_s:.2f}x of one "
        "after another"
    )
    if args.one_seed:
        for r in rows:
            print(f"  lr {r['lr']:g}: in the sweep {r['sweep']:.3f}, alone {r['alone']:.3f}")
        return
    print(
        f"\n  {'lr':>8} {'in the sweep':>13} {'alone':>8} {'alone, seed 1':>14} "
        f"{'|sweep-alone|':>14} {'|seed 1-alone|':>15}"
    )
    for r in rows:
        print(
            f"  {r['lr']:8g} {r['sweep']:13.3f} {r['alone']:8.3f} {r['alone_seed1']:14.3f} "
            f"{abs(r['sweep'] - r['alone']):14.3f} {abs(r['alone_seed1'] - r['alone']):15.3f}"
        )
    print(
        f"\n  mean |sweep - alone| {fmean(abs(r['sweep'] - r['alone']) for r in rows):.3f}, mean "
        f"|seed 1 - alone| {fmean(abs(r['alone_seed1'] - r['alone']) for r in rows):.3f}"
    )


if __name__ == "__main__":
    main()
