"""The default algorithm's recorded baseline: recipes/tiny-arith.yaml (no `algorithm:` section, so
it trains with the default a recipe gets) over 3 seeds, beside `orbit_v1` (the default before), each
`orbit eval`'d on 200 held-out prompts. Writes tests/data/default_run.json, which
tests/test_eval.py's main claim compares its own seed-0 run's gain over the warm start against (the
gains: the accuracies themselves are this machine's, `floats` in the file).

    .venv/bin/python bench/default_run.py [--seeds 0,1,2] [--out runs/default-run]

About 30 s a run on 2 cores; run nothing else meanwhile. Record again when the default changes:
the test refuses a baseline of another preset.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from orbit.config import load_recipe
from orbit.host.floats import float_kernels
from orbit.measure.eval import resolve_target, run_eval
from orbit.models.warmstart import warm_model
from orbit.rl.presets import DEFAULT_PRESET
from orbit.run.lifecycle import train
from orbit.run.preflight import preflight

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny-arith.yaml"
BASELINE = ROOT / "tests" / "data" / "default_run.json"
N = 200


def warm_start() -> Path:
    """The recipe's model: the tiny llama warm-started on arith, cached as the tests cache it."""
    return warm_model("arith", root=ROOT / ".cache")


def one(model: Path, out: Path, seed: int, preset: str | None) -> dict:
    overrides = {"model": str(model), "out": str(out), "seed": seed}
    if preset:
        overrides["algorithm.preset"] = preset
    recipe = load_recipe(RECIPE, overrides)
    train(preflight(recipe), live=False)
    report = run_eval(resolve_target(out), n=N)
    base, trained = report["results"]["base"], report["results"]["trained"]
    return {
        "preset": recipe.algorithm.preset,
        "base": base["accuracy"],
        "trained": trained["accuracy"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "default-run")
    args = p.parse_args()
    model = warm_start()
    runs: dict[str, dict[str, dict]] = {"default": {}, "orbit_v1": {}}
    for seed in (int(s) for s in args.seeds.split(",")):
        for name, preset in (("default", None), ("orbit_v1", "orbit_v1")):
            r = one(model, args.out / f"{name}-s{seed}", seed, preset)
            runs[name][str(seed)] = r
            print(f"seed {seed} {name} ({r['preset']}): {r['base']:.1%} -> {r['trained']:.1%}")
    for name, by_seed in runs.items():
        acc = [r["trained"] for r in by_seed.values()]
        print(f"{name}: median {statistics.median(acc):.1%} [{min(acc):.1%}-{max(acc):.1%}]")
    BASELINE.write_text(
        json.dumps(
            {
                "recipe": "recipes/tiny-arith.yaml",
                "preset": DEFAULT_PRESET,
                "n": N,
                "command": "bench/default_run.py",
                "floats": float_kernels(),
                "runs": runs,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {BASELINE}")


if __name__ == "__main__":
    main()
