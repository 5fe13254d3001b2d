"""`orbit serve` under load: N training clients and N sampling clients at once through the real
`tinker` SDK, on one base and one set of engines. Prints the requests a second, each kind's p50 and
p99 latency, each client's share of the trainer's turns, and the memory a training client costs
(its adapter, gradient and Adam state, measured against the process's growth).

    .venv/bin/python bench/serve_load.py [--model .cache/smollm2-135m-instruct] [--clients 4,8]
        [--steps 4]

Needs `make tinker` (the SDK runs in .venv-tinker, its clients in threads of one process). The
figures are in bench/README.md ("orbit serve under load").
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from statistics import quantiles

import psutil
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def _q(values: list[float], q: float) -> float:
    return quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def one(model: Path, clients: int, steps: int) -> dict:
    from tinker_helpers import sdk, serving  # the tests' way to serve in this process

    from orbit.serve.command import Options

    spec = {"clients": clients, "samplers": clients, "steps": steps, "max_tokens": 16}
    script = ROOT / "tests" / "tinker" / "sdk_service.py"
    engine = {"backend": "embedded", "slots": 4, "max_running": 64, "max_context": 1024}
    with tempfile.TemporaryDirectory() as tmp:
        options = Options(directory=Path(tmp))
        with serving(model, Path(tmp), options, engine=engine) as (url, service):
            rss0 = psutil.Process().memory_info().rss
            seen = sdk(url, model, "load", timeout=3600, script=script, arg=json.dumps(spec))
            rss1 = psutil.Process().memory_info().rss
            trainers = service.live()
            params = sum(p.numel() for t in trainers.values() for p in t.params)
    per_client = params * 4 * 4 / max(len(trainers), 1)  # fp32 weight, gradient, Adam's two
    return {"seen": seen, "rss_growth": (rss1 - rss0) / clients, "per_client": per_client}


def report(clients: int, out: dict) -> None:
    seen = out["seen"]
    rows = seen["clients"]
    n = sum(len(c.get(k, [])) for c in rows.values() for k in ("forward_backward", "optim_step"))
    n += sum(len(c.get("asample", [])) for c in rows.values())
    print(
        f"\n{clients} training + {clients} sampling clients: {n} requests in "
        f"{seen['seconds']:.1f} s ({n / seen['seconds']:.2f} a second)"
    )
    print("| request | p50 s | p99 s |\n|---|---|---|")
    for kind in ("forward_backward", "optim_step", "asample"):
        values = [x for c in rows.values() for x in c.get(kind, [])]
        print(f"| {kind} | {_q(values, 50):.2f} | {_q(values, 99):.2f} |")
    trainers = {k: c for k, c in rows.items() if k.startswith("train")}
    spent = {k: sum(c["forward_backward"]) + sum(c["optim_step"]) for k, c in trainers.items()}
    finished = [c["finished_s"] for c in trainers.values()]
    print(
        f"training clients finished between {min(finished):.1f} and {max(finished):.1f} s; "
        f"each one's share of the time its requests waited or ran: "
        + ", ".join(f"{spent[k] / sum(spent.values()):.3f}" for k in sorted(spent))
    )
    print(
        f"a training client: {out['per_client'] / 2**20:.1f} MiB of adapter, gradient and Adam "
        f"state; the process grew {out['rss_growth'] / 2**20:.1f} MiB a client"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=ROOT / ".cache" / "smollm2-135m-instruct")
    parser.add_argument("--clients", default="4,8", help="client counts to run, one after another")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for clients in (int(c) for c in args.clients.split(",")):
        report(clients, one(args.model.resolve(), clients, args.steps))


if __name__ == "__main__":
    main()
