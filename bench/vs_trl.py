"""Orbit against TRL's GRPOTrainer on the same workload, one after the other, in one command.

The workload is an Orbit recipe (default the laptop recipe, recipes/smollm2-math.yaml): the same
model, LoRA adapter, prompts (Orbit's stream, in its order) and grader (the task's own), group and
batch, sampling and optimisation; bench/trl_grpo.py maps each onto GRPOConfig and lists what has no
counterpart (OUT/table.md). TRL runs with `use_vllm: false` and torch on `--trl-threads` threads;
Orbit as the recipe says. Both save a checkpoint every `--every` (5) steps, and `orbit eval
CHECKPOINT --n N` reads them all the same way. `--orbit-only` runs Orbit alone (a recipe's change
measured against TRL runs recorded before).

    pip install -c constraints.txt -e '.[trl]'              # TRL 1.16.0, never part of make test
    .venv/bin/python bench/vs_trl.py [--seeds 0,1,2] [--steps 60] [--recipe
    recipes/smollm2-math.yaml]

Printed and written to OUT/table.md and OUT/summary.json, per seed and as the median over the seeds:
wall time (launch to exit) and per step (steps 1-10 and all), generated tokens/s, the largest
process's peak resident memory, the reward per step (OUT/curves.png: both reward curves on one
wall-clock axis), held-out accuracy of the final adapters, held-out accuracy at equal wall-clock
points (at each Orbit checkpoint's time, TRL's newest checkpoint by then), and the time to accuracy:
the wall-clock time (from launch) of each run's first checkpoint at `--reach` (50%) held out or
better, the figure a user compares (OUT/held-out.png: every checkpoint against the wall clock). A
system and seed already run in OUT is not run again. With 2 cores, run nothing else.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from itertools import accumulate
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
ORBIT = [sys.executable, "-m", "orbit.cli"]
LATE = 30  # the late steps' figures are over steps 31 on, where dynamic sampling costs the most


def measured(cmd: list[str], log: Path) -> tuple[float, float]:
    """Run `cmd`; its wall time and the peak resident memory of the largest process in its tree
    (GB)."""
    import psutil

    t0 = time.time()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        peak, root = 0, psutil.Process(proc.pid)
        while proc.poll() is None:
            for p in [root, *root.children(recursive=True)]:
                try:
                    peak = max(peak, p.memory_info().rss)
                except psutil.Error:
                    pass
            time.sleep(0.5)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed; see {log}")
    return time.time() - t0, peak / 1e9


def seed_recipe(args: argparse.Namespace, seed: int) -> Path:
    data = yaml.safe_load(args.recipe.read_text())
    data["seed"], data["trainer"]["steps"] = seed, args.steps
    data["trainer"]["save_every"], data["trainer"]["keep_last"] = args.every, 1000
    path = args.out / f"recipe-{seed}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run_orbit(args: argparse.Namespace, seed: int) -> dict:
    out = args.out / f"orbit-{seed}"
    done = args.out / f"orbit-{seed}.json"
    if done.is_file():
        return json.loads(done.read_text())
    t0 = time.time()
    wall, peak = measured(
        [*ORBIT, "train", str(seed_recipe(args, seed)), "--out", str(out), "--quiet"],
        args.out / f"orbit-{seed}.log",
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    checkpoints = []
    for step_dir in sorted((out / "checkpoints").glob("step-*"), key=lambda p: int(p.name[5:])):
        # an adapter with its recipe: what orbit eval reads
        here = args.out / f"orbit-{seed}-eval" / step_dir.name
        here.mkdir(parents=True, exist_ok=True)
        (here / "recipe.yaml").write_text((out / "recipe.yaml").read_text())
        if not (here / "adapter").exists():
            (here / "adapter").symlink_to(step_dir.resolve())
        saved = (step_dir / "trainer_state.json").stat().st_mtime - t0
        checkpoints.append({"step": int(step_dir.name[5:]), "t": saved, "dir": str(here)})
    result = {
        "wall_s": wall,
        "peak_gb": peak,
        "checkpoints": checkpoints,
        "steps": [
            {
                "step": r["step"],
                "step_s": r["step_s"],
                "reward": r["reward_mean"],
                "generated": r["tokens_generated"],
                "trained": r["trained_tokens"],
                "wait_s": r["train_wait_s"],
            }
            for r in rows
        ],
    }
    done.write_text(json.dumps(result))
    return result


def run_trl(args: argparse.Namespace, seed: int) -> dict:
    out = args.out / f"trl-{seed}"
    done = args.out / f"trl-{seed}.json"
    if done.is_file():
        return json.loads(done.read_text())
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "trl_grpo.py"),
        str(seed_recipe(args, seed)),
        "--seed",
        str(seed),
        "--out",
        str(out),
        "--threads",
        str(args.trl_threads),
        "--save-every",
        str(args.every),
    ]
    wall, peak = measured(cmd, args.out / f"trl-{seed}.log")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    batch = yaml.safe_load(args.recipe.read_text())["rollout"]
    per_step = batch["group_size"] * batch["prompts_per_step"]
    checkpoints = [
        {
            "step": int(d.name[5:]),
            "t": json.loads((d / "time.json").read_text())["t"],
            "dir": str(d),
        }
        for d in sorted(out.glob("step-*"), key=lambda p: int(p.name[5:]))
    ]
    previous = [0.0] + [r["t"] for r in rows[:-1]]
    result = {
        "wall_s": wall,
        "peak_gb": peak,
        "checkpoints": checkpoints,
        "steps": [
            {
                "step": r["step"],
                "step_s": r["t"] - p,
                "reward": r["reward"],
                "generated": r["completions/mean_length"] * per_step,
            }
            for r, p in zip(rows, previous, strict=True)
        ],
        "matched": json.loads((out / "matched.json").read_text()),
    }
    done.write_text(json.dumps(result))
    return result


def evaluate(args: argparse.Namespace, result: dict) -> None:
    """Held-out accuracy through `orbit eval` (2 engine threads: nothing else runs) of every
    checkpoint (the time to accuracy needs them all). The base model is read once for the whole
    OUT (the same held-out prompts, greedy)."""
    base = args.out / "base.json"
    for c in result["checkpoints"]:
        with_base = not base.is_file()
        # the adapter alone: no base again
        target = Path(c["dir"]) if with_base else Path(c["dir"]) / "adapter"
        report = target / "eval.json"
        if not with_base and (Path(c["dir"]) / "eval.json").is_file():
            report = Path(c["dir"]) / "eval.json"  # the one read with the base, reported again
        if not report.is_file():
            subprocess.run(
                [*ORBIT, "eval", str(target), "--n", str(args.n), "--threads", "2"],
                cwd=ROOT,
                check=True,
                stdout=subprocess.DEVNULL,
            )
        r = json.loads(report.read_text())["results"]
        c["accuracy"] = r["trained"]["accuracy"]
        if with_base:
            base.write_text(json.dumps({"accuracy": r["base"]["accuracy"]}))
    result["base_accuracy"] = json.loads(base.read_text())["accuracy"]


def newest_by(result: dict, t: float) -> dict | None:
    """The newest checkpoint saved by wall-clock time `t`, or None before the first."""
    ready = [c for c in result["checkpoints"] if c["t"] <= t]
    return ready[-1] if ready else None


def at(result: dict, t: float) -> float:
    """Held-out accuracy of the newest checkpoint saved by wall-clock time `t` (the base model
    before any)."""
    c = newest_by(result, t)
    return c["accuracy"] if c is not None else result["base_accuracy"]


def time_to(result: dict, reach: float) -> float | None:
    """Wall-clock seconds from launch to the first checkpoint held out at `reach` or better (None:
    never within the run)."""
    return next((c["t"] for c in result["checkpoints"] if c["accuracy"] >= reach), None)


def figures(result: dict, reach: float) -> dict:
    steps, late = result["steps"], result["steps"][LATE:]
    orbit = "trained" in steps[0]  # TRL's metrics have no trained tokens or wait
    at_10 = [c["accuracy"] for c in result["checkpoints"] if c["step"] == 10]
    return {
        "held_out_10": at_10[0] if at_10 else None,
        "generated_per_trained_late": sum(s["generated"] for s in late)
        / max(sum(s["trained"] for s in late), 1)
        if orbit and late
        else None,
        "wait_share_late": sum(s["wait_s"] for s in late) / sum(s["step_s"] for s in late)
        if orbit and late
        else None,
        "time_to_reach_s": time_to(result, reach),
        "wall_s": result["wall_s"],
        "step_first10_s": statistics.median(s["step_s"] for s in steps[:10]),
        "step_all_s": statistics.median(s["step_s"] for s in steps),
        "tok_per_s": sum(s["generated"] for s in steps) / sum(s["step_s"] for s in steps),
        "peak_gb": result["peak_gb"],
        "final_accuracy": result["checkpoints"][-1]["accuracy"],
        "base_accuracy": result["base_accuracy"],
    }


def cell(fmt: str, value: float | None, key: str = "time_to_reach_s") -> str:
    """A figure, or what its absence means (a threshold never reached; a figure this system has
    not)."""
    if value is None:
        return "not reached" if key == "time_to_reach_s" else "-"
    return fmt.format(value)


def median_ratio(runs: dict, key: str) -> str:
    """TRL's figure over Orbit's, the median over the seeds where both have one."""
    pairs = [(r["trl"]["figures"][key], r["orbit"]["figures"][key]) for r in runs.values()]
    ratios = [t / o for t, o in pairs if t is not None and o]
    return f"{statistics.median(ratios):.2f}×" if ratios else "-"


ROWS = [
    ("held-out accuracy at step 10", "held_out_10", "{:.1%}"),
    (
        f"engine tokens per trained token, steps {LATE + 1} on",
        "generated_per_trained_late",
        "{:.2f}",
    ),
    (f"trainer's wait, share of the step, steps {LATE + 1} on", "wait_share_late", "{:.0%}"),
]


def orbit_report(args: argparse.Namespace, runs: dict) -> str:
    """Orbit's figures alone (`--orbit-only`): per seed and the median."""
    seeds = sorted(runs)
    rows = [
        (f"time to {args.reach:.0%} held out, from launch (s)", "time_to_reach_s", "{:.0f}"),
        *ROWS,
        ("wall time, launch to exit (s)", "wall_s", "{:.0f}"),
        ("median step, all steps (s)", "step_all_s", "{:.1f}"),
        (f"held-out accuracy after {args.steps} steps", "final_accuracy", "{:.1%}"),
    ]
    lines = [
        f"`{args.recipe}`, {args.steps} steps, checkpoints every {args.every}; base model held out "
        f"{runs[seeds[0]]['orbit']['figures']['base_accuracy']:.1%}",
        "",
        "| | " + " | ".join(f"seed {s}" for s in seeds) + " | median |",
        "|---" * (len(seeds) + 2) + "|",
    ]
    for label, key, fmt in rows:
        values = [runs[s]["orbit"]["figures"][key] for s in seeds]
        known = [v for v in values if v is not None]
        mid = cell(fmt, statistics.median(known)) if known else "-"
        cells = " | ".join(cell(fmt, v, key) for v in values)
        lines.append(f"| {label} | {cells} | {mid} |")
    lines += ["", "Held out at each checkpoint:", ""]
    for s in seeds:
        held = " / ".join(f"{c['accuracy']:.1%}" for c in runs[s]["orbit"]["checkpoints"])
        lines.append(f"- seed {s}: {held}")
    return "\n".join(lines)


def report(args: argparse.Namespace, runs: dict) -> str:
    rows = [
        ("wall time, launch to exit (s)", "wall_s", "{:.0f}"),
        ("median step, steps 1-10 (s)", "step_first10_s", "{:.1f}"),
        ("median step, all steps (s)", "step_all_s", "{:.1f}"),
        ("generated tokens/s", "tok_per_s", "{:.0f}"),
        ("largest process, peak resident memory (GB)", "peak_gb", "{:.1f}"),
        (
            f"held-out accuracy after {args.steps} steps (`orbit eval --n {args.n}`)",
            "final_accuracy",
            "{:.1%}",
        ),
        (f"time to {args.reach:.0%} held out, from launch (s)", "time_to_reach_s", "{:.0f}"),
        *ROWS,
    ]
    seeds = sorted(runs)
    head = (
        "| | "
        + " | ".join(f"Orbit seed {s} | TRL seed {s}" for s in seeds)
        + " | median TRL/Orbit |"
    )
    lines = [
        f"`{args.recipe}`, {args.steps} steps, one after the other on this machine; base model "
        f"held-out accuracy {runs[seeds[0]]['orbit']['figures']['base_accuracy']:.1%}",
        "",
        head,
        "|---" * (2 * len(seeds) + 2) + "|",
    ]
    for label, key, fmt in rows:
        cells = []
        for s in seeds:
            cells += [cell(fmt, runs[s][k]["figures"][key], key) for k in ("orbit", "trl")]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {median_ratio(runs, key)} |")
    lines += [
        "",
        "Held-out accuracy at equal wall-clock points (at each Orbit checkpoint's time, TRL's "
        "newest checkpoint by then):",
        "",
        "| seed | wall clock (s) | Orbit step | Orbit | TRL |",
        "|---|---|---|---|---|",
    ]
    for s in seeds:
        for c in runs[s]["orbit"]["checkpoints"]:
            trl = at(runs[s]["trl"], c["t"])
            lines.append(f"| {s} | {c['t']:.0f} | {c['step']} | {c['accuracy']:.1%} | {trl:.1%} |")
    lines += ["", "Not matched:", ""] + [
        f"- {u}" for u in runs[seeds[0]]["trl"]["matched"]["unmatched"]
    ]
    return "\n".join(lines)


def held_out_picture(runs: dict, reach: float, path: Path) -> None:
    """Held-out accuracy at each checkpoint against the wall clock from launch, a line per seed and
    system (Orbit alone with --orbit-only), the base model at 0 s: where each crosses `reach`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    for system, color in (("orbit", "#1f77b4"), ("trl", "#d62728")):
        for (s, run), marker in zip(sorted(runs.items()), "os^vD<>p", strict=False):
            if system not in run:
                continue
            result = run[system]
            t = [0.0] + [c["t"] for c in result["checkpoints"]]
            acc = [result["base_accuracy"]] + [c["accuracy"] for c in result["checkpoints"]]
            name = "Orbit" if system == "orbit" else "TRL"
            ax.plot(
                t, acc, f"{marker}-", color=color, alpha=0.7, markersize=5, label=f"{name} seed {s}"
            )
    ax.axhline(reach, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("wall clock from launch (s)")
    ax.set_ylabel("held-out accuracy (orbit eval --n 200)")
    ax.set_title("Held-out accuracy at each checkpoint, the laptop recipe")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def picture(runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    for system, color in (("orbit", "#1f77b4"), ("trl", "#d62728")):
        for s, run in sorted(runs.items()):
            steps = run[system]["steps"]
            t = list(accumulate(x["step_s"] for x in steps))
            r = [x["reward"] for x in steps]
            smooth = [statistics.fmean(r[max(0, i - 7) : i + 1]) for i in range(len(r))]
            ax.plot(
                t,
                smooth,
                color=color,
                alpha=0.85,
                linewidth=1.5,
                label=f"{'Orbit' if system == 'orbit' else 'TRL'}" if s == min(runs) else None,
            )
    ax.set_xlabel("wall clock (s)")
    ax.set_ylabel("reward, 8-step mean (one line per seed)")
    ax.set_title("Orbit and TRL GRPOTrainer on the laptop recipe")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", type=Path, default=Path("recipes/smollm2-math.yaml"))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--trl-threads", type=int, default=2)
    parser.add_argument(
        "--reach", type=float, default=0.5, help="held-out accuracy whose first crossing is timed"
    )
    parser.add_argument("--every", type=int, default=5, help="steps between checkpoints")
    parser.add_argument(
        "--orbit-only", action="store_true", help="Orbit's runs and figures alone (no TRL)"
    )
    parser.add_argument("--out", type=Path, default=Path("runs/vs-trl"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict = {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        runs[seed] = {"orbit": run_orbit(args, seed)}
        if not args.orbit_only:
            runs[seed]["trl"] = run_trl(args, seed)
        # Evaluated before the next seed trains, so that a cut-short sweep keeps whole seeds.
        for result in runs[seed].values():
            evaluate(args, result)
            result["figures"] = figures(result, args.reach)
    text = orbit_report(args, runs) if args.orbit_only else report(args, runs)
    (args.out / "table.md").write_text(text + "\n")
    (args.out / "summary.json").write_text(json.dumps(runs, indent=1))
    if not args.orbit_only:
        picture(runs, args.out / "curves.png")
    held_out_picture(runs, args.reach, args.out / "held-out.png")
    print(text)


if __name__ == "__main__":
    main()
