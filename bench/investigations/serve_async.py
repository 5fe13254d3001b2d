"""An async RL loop through the real `tinker` SDK on `orbit serve`, on inflight samplers against the
same loop on snapshots, one after the other in one run on one service (the same seed, the same
sums): each step's wall time, the reward, the staleness, and the engines' flips as the service's
page shows them (orbit/serve/page.py).

    .venv/bin/python bench/investigations/serve_async.py [--model .cache/smollm2-135m-instruct]
        [--steps 12]

Needs `make tinker` and `make smollm2`. The loop is tests/tinker/async_rl.py. The figures are in
bench/investigations/service.md ("Inflight samplers against snapshots").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))


def run(model: Path, steps: int, kinds: list[str]) -> dict[str, dict]:
    from tinker_helpers import sdk, serving  # the tests' way to serve in this process

    from orbit.serve.command import Options
    from orbit.serve.page import state

    script = ROOT / "tests" / "tinker" / "async_rl.py"
    engine = {"backend": "embedded", "slots": 4, "max_running": 64, "max_context": 1024}
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        with serving(model, Path(tmp), Options(), engine=engine) as (url, service):
            for kind in kinds:
                flips = sum(e["flips"] for e in state(service)["engines"])
                spec = {"kind": kind, "steps": steps, "groups": 4, "group_size": 8}
                spec.update(off_policy=1, max_tokens=12, lr=3e-4, seed=0)
                seen = sdk(url, model, "async", timeout=3600, script=script, arg=json.dumps(spec))
                page = state(service)
                seen["flips"] = sum(e["flips"] for e in page["engines"]) - flips
                seen["targets"] = page["targets"]
                out[kind] = seen
    return out


def report(out: dict[str, dict]) -> None:
    print(
        "| samplers | s/step (median, steps 2+) | reward, first 3 steps | reward, last 3 | "
        "staleness (mean) | engine flips |"
    )
    print("|---|---|---|---|---|---|")
    for kind, seen in out.items():
        rows = seen["steps"]
        wall = statistics.median(r["seconds"] for r in rows[1:])
        first = statistics.mean(r["reward"] for r in rows[:3])
        last = statistics.mean(r["reward"] for r in rows[-3:])
        stale = statistics.mean(s for r in rows for s in r["staleness"])
        print(f"| {kind} | {wall:.2f} | {first:.3f} | {last:.3f} | {stale:.2f} | {seen['flips']} |")
    if "inflight" in out and "snapshot" in out:
        ratio = statistics.median(r["seconds"] for r in out["inflight"]["steps"][1:]) / (
            statistics.median(r["seconds"] for r in out["snapshot"]["steps"][1:])
        )
        print(f"\ninflight s/step over snapshot s/step: {ratio:.2f}")
    for t in out.get("inflight", {}).get("targets", []):
        print(f"inflight target {t['id']}: published v{t['version']}, engines serve {t['engines']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / ".cache" / "smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--kinds", default="inflight,snapshot")
    args = parser.parse_args()
    report(run(args.model, args.steps, args.kinds.split(",")))


if __name__ == "__main__":
    main()
