"""The algorithm presets side by side on the SmolLM2 laptop recipe, over several seeds.

For each seed, one `orbit sweep` trains every preset at once (each its own adapter on one base and
one engine), then `orbit eval RUN --n 200` reads each adapter's held-out accuracy the same way. Per
preset it reports the median (and range) over the seeds of:
- held-out accuracy after the recipe's steps (greedy, `orbit eval`), and the base model's;
- the worst drop: the largest fall of the reward curve's 8-step mean below its running maximum;
- the step time: the run's own trainer seconds per step (`train_s`; in a sweep the runs share the
  trainer, so
  a run's wall-clock step also holds the others' turns).

The sweeps run the recipe with `trainer.threads: --trainer-threads` (2): a sweep of 7 adapters is
trainer-bound, and the engine's core idles meanwhile. Nothing else differs from the recipe.

    .venv/bin/python bench/algorithms.py [--seeds 0,1,2] [--presets
    orbit_v1,grpo,dr_grpo,dapo,gspo,cispo,rloo]
                                         [--recipe recipes/smollm2-math.yaml] [--steps 60] [--out
                                         runs/algorithms] [--trainer-threads 2]
    .venv/bin/python bench/algorithms.py --report-only --out runs/algorithms     # the table and
    picture again

It writes OUT/summary.json, OUT/table.md and OUT/curves.png (a panel per preset: its reward's 8-step
mean, median and range over seeds). A seed already trained and evaluated in OUT is not run again.
With 2 cores, run nothing else. `--report-only` reads OUT/seed-N/preset=P_seed=N for each seed and
preset, so a table can join sweeps run apart: link their run directories into one OUT.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

from seeds import spread

ROOT = Path(__file__).resolve().parents[1]
ORBIT = [sys.executable, "-m", "orbit.cli"]
WINDOW = 8
# Orbit's default before DAPO: swept as `preset: null` (every field at its own default, the same
# settings as `orbit_v1`), so its runs keep the directory name of the tables measured before the
# name existed (`preset=None_seed=N`); "default" is the name those tables gave it.
OLD_DEFAULT = ("orbit_v1", "default")


def moving_mean(xs: list[float], window: int = WINDOW) -> list[float]:
    return [statistics.fmean(xs[max(0, i - window + 1) : i + 1]) for i in range(len(xs))]


def worst_drop(rewards: list[float]) -> float:
    """The largest fall of the 8-step mean below its running maximum."""
    smooth, peak, worst = moving_mean(rewards), -float("inf"), 0.0
    for x in smooth:
        peak = max(peak, x)
        worst = max(worst, peak - x)
    return worst


def run_dir(out: Path, preset: str, seed: int) -> Path:
    """The sweep's directory of one run (`orbit sweep` names it by what varies)."""
    return (
        out / f"seed-{seed}" / f"preset={'None' if preset in OLD_DEFAULT else preset}_seed={seed}"
    )


def recipe(args: argparse.Namespace) -> Path:
    """The recipe as the sweeps run it: `--trainer-threads` the one change (a sweep is
    trainer-bound; the engine's core idles meanwhile)."""
    import yaml

    data = yaml.safe_load(args.recipe.read_text())
    data["model"] = str((ROOT / data["model"]).resolve())
    data["trainer"]["threads"] = args.trainer_threads
    path = args.out / "recipe.yaml"
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def train_seed(args: argparse.Namespace, seed: int) -> Path:
    out = args.out / f"seed-{seed}"
    presets = ",".join("null" if p in OLD_DEFAULT else p for p in args.presets)
    done = [run_dir(args.out, p, seed) / "metrics.jsonl" for p in args.presets]
    if all(f.is_file() and len(f.read_text().splitlines()) >= args.steps for f in done):
        return out
    cmd = [
        *ORBIT,
        "sweep",
        str(recipe(args)),
        "--vary",
        f"algorithm.preset={presets}",
        "--vary",
        f"seed={seed}",
        "--steps",
        str(args.steps),
        "--out",
        str(out),
        "--quiet",
    ]
    if out.exists():
        cmd.append("--resume")
    print("$", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    return out


def evaluate(run_dir: Path, n: int) -> dict:
    report = run_dir / "eval.json"
    if not report.is_file():
        print("$ orbit eval", run_dir, "--n", n, flush=True)
        subprocess.run(
            [*ORBIT, "eval", str(run_dir), "--n", str(n)],
            cwd=ROOT,
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return json.loads(report.read_text())


def summarise(args: argparse.Namespace) -> dict:
    rows: dict[str, list[dict]] = {p: [] for p in args.presets}
    base = []
    for seed in args.seeds:
        for preset in args.presets:
            where = run_dir(args.out, preset, seed)
            metrics = [
                json.loads(line) for line in (where / "metrics.jsonl").read_text().splitlines()
            ]
            report = evaluate(where, args.n)
            base.append(report["results"]["base"]["accuracy"])
            rows[preset].append(
                {
                    "seed": seed,
                    "accuracy": report["results"]["trained"]["accuracy"],
                    "worst_drop": worst_drop([m["reward_mean"] for m in metrics]),
                    "train_s": statistics.fmean(m["train_s"] for m in metrics),
                    "final_reward": statistics.fmean(m["reward_mean"] for m in metrics[-WINDOW:]),
                    "rewards": [m["reward_mean"] for m in metrics],
                }
            )
    return {
        "recipe": str(args.recipe),
        "steps": args.steps,
        "seeds": args.seeds,
        "n": args.n,
        "base_accuracy": statistics.median(base),
        "presets": rows,
    }


def table(summary: dict) -> str:
    seeds = ", ".join(str(s) for s in summary["seeds"])
    lines = [
        f"SmolLM2-135M-Instruct, `{summary['recipe']}`, {summary['steps']} steps, seeds {seeds}; "
        f"held-out accuracy `orbit eval --n {summary['n']}` (base {summary['base_accuracy']:.1%}). "
        "Median over the seeds, range in brackets.",
        "",
        "| preset | held-out accuracy | worst drop (8-step mean) | final reward (last 8) | trainer "
        "s/step |",
        "|---|---|---|---|---|",
    ]
    for preset, runs in summary["presets"].items():
        acc, drop, reward = (
            spread([r[k] for r in runs], fmt)
            for k, fmt in (
                ("accuracy", "{:.1%}"),
                ("worst_drop", "{:.3f}"),
                ("final_reward", "{:.3f}"),
            )
        )
        step = statistics.median(r["train_s"] for r in runs)
        lines.append(f"| {preset} | {acc} | {drop} | {reward} | {step:.2f} |")
    return "\n".join(lines)


def _band(runs: list[dict]) -> tuple[list[float], list[float], list[float]]:
    """The median, lowest and highest 8-step mean reward over the seeds, step by step."""
    curves = [moving_mean(r["rewards"]) for r in runs]
    steps = range(min(len(c) for c in curves))
    return (
        [statistics.median(c[i] for c in curves) for i in steps],
        [min(c[i] for c in curves) for i in steps],
        [max(c[i] for c in curves) for i in steps],
    )


def picture(summary: dict, path: Path) -> None:
    """One small panel per preset (its median and range over seeds), every other preset's median in
    grey behind it: seven overlapping bands on one axis cannot be told apart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bands = {preset: _band(runs) for preset, runs in summary["presets"].items()}
    cols = min(4, len(bands))
    rows = -(-len(bands) // cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(3.2 * cols, 2.7 * rows), sharex=True, sharey=True, squeeze=False
    )
    for ax, (preset, (median, low, high)) in zip(axes.flat, bands.items(), strict=False):
        for other, (curve, _, _) in bands.items():
            if other != preset:
                ax.plot(range(1, len(curve) + 1), curve, color="0.8", linewidth=1)
        steps = range(1, len(median) + 1)
        ax.fill_between(steps, low, high, color="C0", alpha=0.2)
        ax.plot(steps, median, color="C0", linewidth=2)
        accuracy = spread([r["accuracy"] for r in summary["presets"][preset]], "{:.1%}")
        ax.set_title(f"{preset}: {accuracy} held out", fontsize=9)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(bands) :]:
        ax.axis("off")
    fig.supxlabel("step")
    fig.supylabel(f"reward, {WINDOW}-step mean")
    title = (
        f"{Path(summary['recipe']).name}, seeds {', '.join(map(str, summary['seeds']))}: median "
        "(line) and range (band) over seeds; grey, the other presets' medians"
    )
    # wrapped to the figure's width: one panel is narrower than the line
    fig.suptitle(textwrap.fill(title, width=int(3.2 * cols * 13)), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--presets", default="orbit_v1,grpo,dr_grpo,dapo,gspo,cispo,rloo")
    parser.add_argument("--recipe", type=Path, default=Path("recipes/smollm2-math.yaml"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("runs/algorithms"))
    parser.add_argument("--trainer-threads", type=int, default=2)
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.presets = args.presets.split(",")
    if not args.report_only:
        for seed in args.seeds:
            train_seed(args, seed)
    summary = summarise(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    text = table(summary)
    (args.out / "table.md").write_text(text + "\n")
    picture(summary, args.out / "curves.png")
    print(text)


if __name__ == "__main__":
    main()
