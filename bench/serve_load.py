"""`orbit serve` under load, packed against turn by turn in one run: N training clients (and, with
`--samplers`, N sampling clients) at once through the real `tinker` SDK, on one base and one set of
engines. For each client count and each way the trainer runs their requests (`packed`: the ready
clients' forward_backward requests share a pass over the base, orbit/train/packing.py; `turns`:
`--pack-tokens 0`, one request a pass), it prints the tokens trained a second summed over clients,
the requests a second, each kind's p50 and p99 latency (and a step's: forward_backward plus
optim_step), the trainer's useful FLOP rate against this machine's measured matmul peak, and the
process's peak memory; then the packed-over-turns ratios.

    .venv/bin/python bench/serve_load.py [--model .cache/smollm2-135m-instruct]
        [--clients 1,2,4,8,16] [--steps 4] [--group 4 --prompt 48 --completion 16] [--samplers]
        [--device cpu|cuda:0]

A step's batch is RL-shaped (tests/tinker/sdk_service.py `group`): `--group` sequences of one
`--prompt`-token prompt and `--completion` tokens each, cross-entropy on the completion. Needs
`make tinker` (the SDK runs in .venv-tinker, its clients in threads of one process). The figures are
in bench/README.md ("orbit serve under load"). With `--device cuda:0` the trainer and the embedded
engine (bf16) are on that GPU (scripts/gpu/check.py's `load` step), and no CPU matmul peak is
measured (no FLOP fraction).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from statistics import quantiles

import torch
from transformers import AutoConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

MODES = {"turns": 0, "packed": None}  # --pack-tokens: 0, or the service's default


def _q(values: list[float], q: int) -> float:
    return quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def one(model: Path, mode: str, clients: int, args: argparse.Namespace) -> dict:
    from tinker_helpers import sdk, serving  # the tests' way to serve in this process

    from orbit.measure.memory import PeakRss
    from orbit.serve.command import Options

    spec = {
        "clients": clients,
        "samplers": clients if args.samplers else 0,
        "steps": args.steps,
        "max_tokens": 16,
        "group": args.group,
        "prompt": args.prompt,
        "completion": args.completion,
        # token ids the model has (the GPU check's model has the tiny tokenizer's 384)
        "vocab": min(1000, AutoConfig.from_pretrained(model).vocab_size),
    }
    script = ROOT / "tests" / "tinker" / "sdk_service.py"
    engine = {"backend": "embedded", "slots": 4, "max_running": 64, "max_context": 1024}
    trainer = {"device": args.device}
    if args.device != "cpu":
        engine.update(device=args.device, dtype="bfloat16")
    with tempfile.TemporaryDirectory() as tmp:
        options = Options(directory=Path(tmp))
        if MODES[mode] is not None:
            options = dataclasses.replace(options, pack_tokens=MODES[mode])
        with serving(model, Path(tmp), options, engine=engine, trainer=trainer) as (url, service):
            with PeakRss() as rss:
                seen = sdk(url, model, "load", timeout=3600, script=script, arg=json.dumps(spec))
            packs = list(service.turns.packs)
    return {"seen": seen, "peak_rss": rss.peak, "packs": packs}


def figures(out: dict, params: int, peak_gflops: float | None) -> dict:
    """What a run shows: trained tokens a second, requests a second, latencies, FLOP rate."""
    seen = out["seen"]
    rows = seen["clients"]
    failed = {k: c["error"] for k, c in rows.items() if "error" in c}
    if failed:
        raise RuntimeError(f"{len(failed)} client(s) failed, e.g. {next(iter(failed.items()))}")
    trainers = {k: c for k, c in rows.items() if k.startswith("train")}
    tokens = sum(sum(c.get("tokens", [])) for c in trainers.values())
    # the training clients' span: from the start to the last one's end (samplers may run longer)
    span = max(c["finished_s"] for c in trainers.values())
    n = sum(len(c.get(k, [])) for c in rows.values() for k in ("forward_backward", "optim_step"))
    n += sum(len(c.get("asample", [])) for c in rows.values())
    latency = {}
    for kind in ("forward_backward", "optim_step", "asample"):
        values = [x for c in rows.values() for x in c.get(kind, [])]
        if values:
            latency[kind] = (_q(values, 50), _q(values, 99))
    # a training step, as its client sees it: its forward_backward and its optim_step, each from
    # when it was sent to when it was answered
    steps = [
        f + o
        for c in trainers.values()
        for f, o in zip(c["forward_backward"], c["optim_step"], strict=True)
    ]
    latency["step"] = (_q(steps, 50), _q(steps, 99))
    # forward_backward after each client's first: a client's first waits behind the other
    # clients' creation (the trainer adds each adapter before it runs a pass)
    warm = [x for c in trainers.values() for x in c["forward_backward"][1:]]
    if warm:
        latency["forward_backward_warm"] = (_q(warm, 50), _q(warm, 99))
    packs = out["packs"]
    return {
        "tokens_s": tokens / span,
        "requests_s": n / seen["seconds"],
        "latency": latency,
        "useful_gflops": 4 * params * tokens / span / 1e9,
        "of_peak": 4 * params * tokens / span / 1e9 / peak_gflops if peak_gflops else None,
        "peak_rss_mib": out["peak_rss"] / 2**20,
        "requests_a_pack": sum(p.clients for p in packs) / max(len(packs), 1),
        "seconds": span,
    }


def report(clients: int, results: dict[str, dict]) -> None:
    kinds = [
        k for k in ("forward_backward", "optim_step", "asample") if k in results["turns"]["latency"]
    ]
    samplers = " + as many sampling clients" if "asample" in kinds else ""
    print(f"\n{clients} training clients{samplers}:")
    head = "| | tokens/s | requests/s | " + " | ".join(f"{k} p50 / p99 s" for k in kinds)
    print(head + " | useful GFLOP/s (of peak) | requests a pack | peak RSS MiB |")
    print("|---" * (len(kinds) + 6) + "|")
    for mode, r in results.items():
        lat = " | ".join(f"{r['latency'][k][0]:.2f} / {r['latency'][k][1]:.2f}" for k in kinds)
        print(
            f"| {mode} | {r['tokens_s']:.0f} | {r['requests_s']:.2f} | {lat} | "
            f"{r['useful_gflops']:.1f} ({_ratio(r['of_peak'])}) | {r['requests_a_pack']:.2f} | "
            f"{r['peak_rss_mib']:.0f} |"
        )
    t, p = results["turns"], results["packed"]
    fb, warm = "forward_backward", "forward_backward_warm"
    after = ""
    if warm in p["latency"]:
        after = (
            f" (after each client's first: {p['latency'][warm][1] / t['latency'][warm][1]:.2f}, "
            f"{t['latency'][warm][1]:.2f} -> {p['latency'][warm][1]:.2f} s)"
        )
    print(
        f"packed / turns: tokens/s {p['tokens_s'] / t['tokens_s']:.2f}, "
        f"p99 {fb} {p['latency'][fb][1] / t['latency'][fb][1]:.2f}{after}, "
        f"p99 step {p['latency']['step'][1] / t['latency']['step'][1]:.2f}"
    )


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def main() -> None:
    from orbit.measure.flops import matmul_params, matmul_peak

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, default=ROOT / ".cache" / "smollm2-135m-instruct")
    parser.add_argument("--clients", default="1,2,4,8,16", help="client counts, one after another")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--group", type=int, default=4, help="sequences a forward_backward")
    parser.add_argument("--prompt", type=int, default=48, help="a group's prompt tokens")
    parser.add_argument("--completion", type=int, default=16, help="each sequence's own tokens")
    parser.add_argument("--samplers", action="store_true", help="as many sampling clients too")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--device", default="cpu", help="the trainer's and the engine's")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = args.model.resolve()
    params = matmul_params(model)
    peak = None
    if args.device == "cpu":
        peak = matmul_peak(1)  # the trainer's threads (recipe default trainer.threads: 1)
        print(f"matmul peak, 1 thread: {peak:.1f} GFLOP/s; {params / 1e6:.1f} M weights a token")
    everything = {}
    for clients in (int(c) for c in args.clients.split(",")):
        results = {}
        for mode in MODES:
            t0 = time.time()
            results[mode] = figures(one(model, mode, clients, args), params, peak)
            results[mode]["wall_s"] = time.time() - t0
        report(clients, results)
        everything[clients] = results
        if args.json:  # after each count: a run stopped by a time limit keeps what it measured
            args.json.write_text(json.dumps(everything, indent=1))
    if 1 in everything and len(everything) > 1:
        print("\nsummed trained tokens/s over one client's:")
        for mode in MODES:
            one_s = everything[1][mode]["tokens_s"]
            ratios = ", ".join(
                f"{n}: {r[mode]['tokens_s'] / one_s:.2f}" for n, r in everything.items()
            )
            print(f"  {mode}: {ratios}")


if __name__ == "__main__":
    main()
