"""What the live page costs a run: the same run with and without `--watch` (a headless browser on
the page the whole time, polling once a second), alternated so that both see the same machine, side
by side in one script.

    .venv/bin/python bench/investigations/watch_cost.py [--recipe recipes/tiny.yaml] [--steps 40]
        [--pairs 3]

Prints each run's median step time and the ratio watched / unwatched per pair and overall (the
median of the pairs). Needs chromium (`make browser`). With 2 cores, run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))


def run(recipe: Path, out: Path, steps: int, watch: bool) -> float:
    """One run through the command line; with `watch`, a browser on its page until it ends. Its
    median step."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "orbit.cli",
        "train",
        str(recipe),
        "--steps",
        str(steps),
        "--out",
        str(out),
        "--quiet",
    ] + (["--watch"] if watch else [])
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    if watch:
        from browser import browser

        url = None
        for line in proc.stdout:
            if line.startswith("live page: "):
                url = line.split()[-1]
                break
        with browser() as page:
            page.goto(url)
            while proc.poll() is None:
                time.sleep(0.5)
    proc.communicate()
    assert proc.returncode == 0, f"{cmd} failed"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_s"] for r in rows[2:])  # past the first steps (start-up)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", type=Path, default=Path("recipes/tiny.yaml"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("runs/bench-watch"))
    args = parser.parse_args()
    ratios = []
    for pair in range(args.pairs):
        plain = run(args.recipe, args.out / f"plain-{pair}", args.steps, watch=False)
        watched = run(args.recipe, args.out / f"watched-{pair}", args.steps, watch=True)
        ratios.append(watched / plain)
        print(
            f"pair {pair}: median step {plain * 1e3:.1f} ms without the page, {watched * 1e3:.1f} "
            f"ms with it ({ratios[-1]:.3f}x)",
            flush=True,
        )
    print(
        f"watched / unwatched, median of {args.pairs} pairs: {statistics.median(ratios):.3f}x "
        f"(range {min(ratios):.3f}-{max(ratios):.3f})"
    )


if __name__ == "__main__":
    main()
