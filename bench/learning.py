"""Where learning per step goes: the laptop recipe against each of its differences from TRL's
GRPOTrainer, one at a time, over several seeds.

Each variant is the recipe under Orbit's default algorithm (DAPO with its overlong penalty) with a
few fields changed (VARIANTS). Per seed, the variants that share a loop mode train together as one
`orbit sweep` (one base, one engine; the step counts are the runs' own, so the sweep changes the
wall clock, not what a step learns; a sweep is double-buffered, so a variant in another mode trains
alone), with a checkpoint every `--every` steps; `orbit eval` reads each checkpoint's held-out
accuracy (greedy, `--n` prompts). It prints and writes OUT/table.md, OUT/summary.json and
OUT/curves.png: per variant, held-out accuracy at each checkpoint (median and range over the seeds)
and each seed's first checkpoint at `--reach`.

    .venv/bin/python bench/learning.py [--seeds 0,1,2] [--steps 20] [--every 5] [--n 200]
                                       [--recipe recipes/smollm2-math.yaml] [--out runs/learning]
    .venv/bin/python bench/learning.py --report-only --seeds 0 --variants default,sync   # a table

A seed already trained and evaluated in OUT is not run again. With 2 cores, run nothing else.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import yaml
from seeds import spread

from orbit.config import set_dotted

ROOT = Path(__file__).resolve().parents[1]
ORBIT = [sys.executable, "-m", "orbit.cli"]

# What TRL's GRPOTrainer does differently on this recipe (bench/trl_grpo.py matches the rest: the
# aggregation, the clip, the group, the learning rate), each alone, and all of them together.
TRL = {"mode": "sync", "algorithm.dynamic_sampling": False, "algorithm.overlong": "none"}
VARIANTS: dict[str, dict] = {
    "default": {},
    "sync": {"mode": "sync"},  # on-policy: no one-version lag
    "no-dynamic-sampling": {"algorithm.dynamic_sampling": False},
    "no-overlong-penalty": {"algorithm.overlong": "none"},
    "lr-2x": {"trainer.lr": 6e-4},
    "trl-settings": TRL,
    # not a difference from TRL: staged sampling, the engine spared the groups a policy solves
    "screen": {"algorithm.screen": 2},
}


def _recipe(args: argparse.Namespace, mode: str, seed: int) -> dict:
    """The recipe as every variant of a seed in `mode` starts from."""
    data = yaml.safe_load(args.recipe.read_text())
    data["model"] = str((ROOT / data["model"]).resolve())
    data["mode"], data["seed"] = mode, seed
    data["trainer"].update(steps=args.steps, save_every=args.every, keep_last=1000)
    # Every variant is one change from Orbit's default algorithm, DAPO with its overlong penalty,
    # as the tables were measured (recipes/smollm2-math.yaml has since dropped the penalty)
    set_dotted(data, "algorithm.overlong", "penalty")
    return data


def sweep_file(args: argparse.Namespace, mode: str, names: list[str], seed: int) -> Path:
    """A sweep of the variants run in `mode`: the recipe, each variant's fields but the mode."""
    data = _recipe(args, mode, seed)
    data["runs"] = [
        {"name": n, **{k: v for k, v in VARIANTS[n].items() if k != "mode"}} for n in names
    ]
    path = args.out / f"sweep-{mode}-{seed}-all.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def recipe_file(args: argparse.Namespace, mode: str, name: str, seed: int) -> Path:
    """One variant's recipe, to train alone."""
    data = _recipe(args, mode, seed)
    for key, value in VARIANTS[name].items():
        set_dotted(data, key, value)
    path = args.out / f"sweep-{mode}-{seed}-{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def train(args: argparse.Namespace, seed: int) -> None:
    by_mode: dict[str, list[str]] = {}
    for name in args.variants:
        by_mode.setdefault(VARIANTS[name].get("mode", "double-buffer"), []).append(name)
    for mode, names in by_mode.items():
        out = args.out / f"seed-{seed}-{mode}"
        if all(_done(out / n, args.steps) for n in names):
            continue
        if mode == "double-buffer" and len(names) > 1:  # a sweep is double-buffered only
            cmd = [*ORBIT, "sweep", str(sweep_file(args, mode, names, seed))]
            _run(cmd + ["--out", str(out), "--quiet"] + (["--resume"] if out.exists() else []))
            continue
        for name in names:  # each alone, in the directory a sweep would give it
            if _done(out / name, args.steps):
                continue
            recipe = recipe_file(args, mode, name, seed)
            resume = ["--resume"] if (out / name).exists() else []
            _run([*ORBIT, "train", str(recipe), "--out", str(out / name), "--quiet", *resume])


def _run(cmd: list[str]) -> None:
    print("$", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def _done(run: Path, steps: int) -> bool:
    metrics = run / "metrics.jsonl"
    return metrics.is_file() and len(metrics.read_text().splitlines()) >= steps


def run_dir(args: argparse.Namespace, name: str, seed: int) -> Path:
    return args.out / f"seed-{seed}-{VARIANTS[name].get('mode', 'double-buffer')}" / name


def evaluate(args: argparse.Namespace, run: Path) -> dict[int, float]:
    """Held-out accuracy of every checkpoint of a run (an adapter beside its run's recipe)."""
    found = {}
    for step_dir in sorted(run.glob("checkpoints/step-*"), key=lambda p: int(p.name[5:])):
        here = run / "eval" / step_dir.name
        here.mkdir(parents=True, exist_ok=True)
        (here / "recipe.yaml").write_text((run / "recipe.yaml").read_text())
        if not (here / "adapter").exists():
            (here / "adapter").symlink_to(step_dir.resolve())
        report = here / "eval.json"
        if not report.is_file() and args.report_only:
            return {}  # not evaluated yet: left out of the table
        if not report.is_file():
            print("$ orbit eval", here, flush=True)
            subprocess.run(
                [*ORBIT, "eval", str(here), "--n", str(args.n), "--threads", "2"],
                cwd=ROOT,
                check=True,
                stdout=subprocess.DEVNULL,
            )
        results = json.loads(report.read_text())["results"]
        found[int(step_dir.name[5:])] = results["trained"]["accuracy"]
        found[0] = results["base"]["accuracy"]
    return found


def reached(curve: dict[int, float], reach: float) -> int | None:
    return next((s for s in sorted(curve) if s and curve[s] >= reach), None)


def table(args: argparse.Namespace, curves: dict[str, list[dict[int, float]]]) -> str:
    steps = sorted({s for runs in curves.values() for c in runs for s in c if s})
    head = (
        "| variant | " + " | ".join(f"step {s}" for s in steps) + f" | first at {args.reach:.0%} |"
    )
    lines = [head, "|---" * (len(steps) + 2) + "|"]
    for name, runs in curves.items():
        if not runs:
            continue
        cells = [spread([c[s] * 100 for c in runs if s in c], "{:.1f}") for s in steps]
        firsts = [reached(c, args.reach) for c in runs]
        first = ", ".join("-" if f is None else str(f) for f in firsts)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | steps {first} |")
    base = statistics.median(c[0] for runs in curves.values() for c in runs)
    seeds = {n: len(runs) for n, runs in curves.items()}
    if len(set(seeds.values())) > 1:  # say which variants ran fewer seeds
        lines.append("")
        lines.append("Seeds per variant: " + ", ".join(f"{n} {k}" for n, k in seeds.items()))
    return "\n".join(
        [
            f"`{args.recipe}`, seeds {args.seeds}, held out (%, `orbit eval --n {args.n}`, median "
            f"[range]); base model {base:.1%}; each variant: {_fields()}",
            "",
            *lines,
        ]
    )


def picture(curves: dict[str, list[dict[int, float]]], path: Path) -> None:
    """Held out against the step, a line per variant: its seeds' median, their range shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for name, runs in curves.items():
        if not runs:
            continue
        steps = sorted({s for c in runs for s in c})
        values = [[c[s] * 100 for c in runs if s in c] for s in steps]
        (line,) = ax.plot(steps, [statistics.median(v) for v in values], marker="o", label=name)
        lows, highs = [min(v) for v in values], [max(v) for v in values]
        ax.fill_between(steps, lows, highs, color=line.get_color(), alpha=0.12)
    ax.axhline(50, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("held out (%), median over seeds, range shaded")
    ax.set_title("Learning per step on the laptop recipe: each difference from TRL alone")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _fields() -> str:
    return "; ".join(f"{n}: {v or 'the recipe'}" for n, v in VARIANTS.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--reach", type=float, default=0.5)
    parser.add_argument("--recipe", type=Path, default=Path("recipes/smollm2-math.yaml"))
    parser.add_argument("--out", type=Path, default=Path("runs/learning"))
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="the table from the runs evaluated in OUT, none trained or evaluated",
    )
    args = parser.parse_args()
    args.variants = args.variants.split(",")
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    curves: dict[str, list[dict[int, float]]] = {n: [] for n in args.variants}
    for seed in (int(s) for s in args.seeds.split(",")):
        if not args.report_only:
            train(args, seed)
        for name in args.variants:
            curve = evaluate(args, run_dir(args, name, seed))
            if _done(run_dir(args, name, seed), args.steps) and curve:
                curves[name].append(curve)
        text = table(args, curves)
        (args.out / "table.md").write_text(text + "\n")
        (args.out / "summary.json").write_text(json.dumps(curves, indent=1))
        picture(curves, args.out / "curves.png")
        print(text, flush=True)


if __name__ == "__main__":
    main()
