"""Where borrowing the engine's core goes: every trainer layer timed, with the threads it ran on.

    .venv/bin/python bench/investigations/borrow_trace.py [--recipe recipes/smollm2-math.yaml]
        [--steps 8] [--engine embedded] [--out runs/borrow-trace] [--probe-every 97] [--hold 2]

bench/investigations/cores.py measured the trainer borrowing at 45% of its checks beside the
embedded engine and training no faster per token. This runs the recipe once with
`trainer.borrow_cores` on, in this process, and records each of the trainer's thread checks
(orbit/train/cores.py: before a decoder layer's forward and as its gradient arrives) with the time
and the thread count it set, and each time the pipeline says the engines went idle or busy. The time
from one check to the next of the same kind is one layer's forward (or backward) on the threads the
first set. Printed: a layer's median forward and backward time on 1 thread and on 2 threads, and how
long the engines' idle spells last, and the CPU seconds that each thread of this process, each
engine's process and the machine's idle and stolen time took while the engines were idle and while
they were busy. `--probe-every N` also times a torch.mm of a layer's shape on 1 and on 2 threads at
every Nth check (what the cores give at that moment); `--hold 2` keeps the trainer on 2 threads
throughout and tags each layer by whether the engines were idle instead. With 2 cores, run nothing
else meanwhile.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import torch
import yaml

from orbit.config import load_recipe
from orbit.run.lifecycle import train
from orbit.run.preflight import preflight
from orbit.train import cores

# (time, kind, threads or idle flag, the layer's tokens: its input's rows)
EVENTS: list[tuple[float, str, int, int]] = []
# (engines idle, torch.mm GFLOP/s on 1 thread, on 2) at every --probe-every'th check
PROBES: list[tuple[bool, float, float]] = []
# (time, engines idle from now, each of this process's threads' [user s, system s, minor faults])
SWITCHES: list[tuple[float, bool, dict[str, list[float]]]] = []


def thread_cpu() -> dict[str, list[float]]:
    """[user CPU seconds, system CPU seconds, minor page faults] of each thread of this process so
    far, by name (Python's threads by their names, the others, OpenMP's workers among them, by their
    kernel name and id)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            stat = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        name = names.get(int(task.name), f"{comm} {task.name}")
        # fields 10, 14 and 15 of proc_pid_stat(5): minflt, utime, stime
        out[name] = [int(stat[11]) / tick, int(stat[12]) / tick, float(stat[7])]
    # the engines' processes, whole, and the machine's idle and stolen time (proc_stat(5))
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
            out[f"process {child.pid} {child.name()}"] = [times.user, times.system, 0.0]
        except psutil.Error:
            continue
    cpu = [int(x) / tick for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    out["machine: idle"], out["machine: stolen"] = [cpu[3] + cpu[4], 0.0, 0.0], [cpu[7], 0.0, 0.0]
    return out


def cpu_by_thread(switches: list) -> dict[bool, dict[str, list[float]]]:
    """{engines idle: {thread: [user s, system s, minor faults]}} summed over the spells between
    switches."""
    out: dict[bool, dict[str, list[float]]] = {False: {}, True: {}}
    for (_, idle, before), (_, _, after) in itertools.pairwise(switches):
        for name, now in after.items():
            then = before.get(name, [0.0, 0.0, 0.0])
            total = out[idle].setdefault(name, [0.0, 0.0, 0.0])
            for i in range(3):
                total[i] += now[i] - then[i]
    return out


def describe(by_thread: dict[str, list[float]]) -> str:
    """One line: the machine's idle and stolen seconds (which have no system time or faults), then
    each thread and process that ran 0.05 s or more, busiest first."""
    machine = {k: v for k, v in by_thread.items() if k.startswith("machine: ")}
    ran = sorted(
        ((k, v) for k, v in by_thread.items() if k not in machine and v[0] + v[1] >= 0.05),
        key=lambda kv: -(kv[1][0] + kv[1][1]),
    )
    return "; ".join(
        [f"{name} {seconds:.1f}" for name, (seconds, _, _) in machine.items()]
        + [f"{name} {u:.1f} user + {s:.1f} sys, {f:.0f} faults" for name, (u, s, f) in ran]
    )


def _mm_rate(a: torch.Tensor, b: torch.Tensor, threads: int, reps: int = 20) -> float:
    torch.set_num_threads(threads)
    torch.mm(a, b)
    t = time.perf_counter()
    for _ in range(reps):
        torch.mm(a, b)
    return 2 * a.shape[0] * a.shape[1] * b.shape[1] * reps / (time.perf_counter() - t) / 1e9


def _traced(cls: type[cores.Cores], hold: int | None, probe_every: int, hidden: int) -> None:
    """Record the trainer's checks by kind and the engines' idle switches. `hold`: the trainer on
    that many threads throughout (each check then tags its layer 1 + whether the engines were idle,
    instead of its threads). `probe_every`: time a torch.mm of a layer's shape on 1 and 2 threads
    at every so many checks."""
    apply, engines_idle = cls.apply, cls.engines_idle
    a, b = torch.randn(160, hidden), torch.randn(hidden, 4 * hidden)

    def check(self: cores.Cores, kind: str, x: torch.Tensor) -> None:
        if hold is None:
            apply(self)
            tag = torch.get_num_threads()
        else:
            if torch.get_num_threads() != hold:
                torch.set_num_threads(hold)
            tag = 1 + self._idle.is_set()
        if probe_every and len(EVENTS) % probe_every == 0:
            want = torch.get_num_threads()
            PROBES.append((self._idle.is_set(), _mm_rate(a, b, 1), _mm_rate(a, b, 2)))
            torch.set_num_threads(want)
        EVENTS.append((time.perf_counter(), kind, tag, x.numel() // x.shape[-1]))

    def hook(self: cores.Cores, layers) -> None:
        def on_output(module, args, out) -> None:
            hidden = out[0] if isinstance(out, tuple) else out
            if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
                hidden.register_hook(lambda grad: check(self, "backward", grad))

        for layer in layers:
            layer.register_forward_pre_hook(
                lambda module, args: check(self, "forward", args[0] if args else torch.empty(0, 1))
            )
            layer.register_forward_hook(on_output)

    def idle(self: cores.Cores, flag: bool) -> None:
        engines_idle(self, flag)
        now = time.perf_counter()
        EVENTS.append((now, "idle", int(flag), 0))
        SWITCHES.append((now, flag, thread_cpu()))

    cls.hook = hook  # type: ignore[method-assign]
    cls.engines_idle = idle  # type: ignore[method-assign,assignment]


def layer_times(events: list) -> dict[str, dict[int, dict[int, list[float]]]]:
    """{kind: {tokens: {threads: [seconds a layer]}}} from consecutive checks of the same kind
    (a layer's forward, or its backward, on the threads the first check set)."""
    checks = [e for e in events if e[1] != "idle"]
    out: dict[str, dict[int, dict[int, list[float]]]] = {"forward": {}, "backward": {}}
    for (t0, k0, n0, rows), (t1, k1, _, _) in itertools.pairwise(checks):
        if k0 == k1:
            out[k0].setdefault(rows, {}).setdefault(n0, []).append(t1 - t0)
    return out


def idle_spells(events: list) -> list[float]:
    """How long each idle spell of the engines lasted."""
    spells, since = [], None
    for t, kind, flag, _ in events:
        if kind != "idle":
            continue
        if flag and since is None:
            since = t
        elif not flag and since is not None:
            spells.append(t - since)
            since = None
    return spells


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", type=Path, default=Path("recipes/smollm2-math.yaml"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--engine", default="embedded")
    parser.add_argument("--out", type=Path, default=Path("runs/borrow-trace"))
    parser.add_argument(
        "--hold",
        type=int,
        help="the trainer on this many threads throughout; '1 thread' then reads 'engines busy' "
        "and '2 threads' 'engines idle'",
    )
    parser.add_argument(
        "--probe-every", type=int, default=0, help="time torch.mm on 1 and 2 threads every N checks"
    )
    args = parser.parse_args()
    data = yaml.safe_load(args.recipe.read_text())
    overrides = {
        "out": str(args.out),
        "trainer": {
            **data["trainer"],
            "borrow_cores": True,
            "steps": args.steps,
            "save_every": 10_000,
        },
        "engine": {**data["engine"], "backend": args.engine},
    }
    hidden = json.loads((Path(data["model"]) / "config.json").read_text())["hidden_size"]
    _traced(cores.Cores, args.hold, args.probe_every, hidden)
    train(preflight(load_recipe(args.recipe, overrides)), live=False)
    # the first two steps warm up: keep the events of the steps after them, which end with the run
    rows = [json.loads(x) for x in (args.out / "metrics.jsonl").read_text().splitlines()]
    since = EVENTS[-1][0] - sum(r["step_s"] for r in rows[2:])
    events = [e for e in EVENTS if e[0] >= since]
    report: dict[str, Any] = {"layers": {}, "idle_spells_s": idle_spells(events)}
    for kind, by_rows in layer_times(events).items():
        # like for like: a layer of the same tokens on 1 and on 2 threads
        both = {r: by for r, by in by_rows.items() if {1, 2} <= set(by)}
        one = sum(statistics.median(by[1]) * len(by[2]) for by in both.values())
        two = sum(sum(by[2]) for by in both.values())
        report["layers"][kind] = {
            str(r): {str(n): [len(ts), statistics.median(ts)] for n, ts in by.items()}
            for r, by in sorted(by_rows.items())
        }
        print(
            f"{kind:8s}: {sum(len(by[2]) for by in both.values())} layers on 2 threads in "
            f"{two:.2f} s, which on 1 thread (the median of the same tokens) take {one:.2f} s: "
            f"{one / two if two else float('nan'):.2f}x"
        )
        for r, by in sorted(both.items()):
            print(
                f"  {r:5d} tokens: 1 thread {1e3 * statistics.median(by[1]):6.1f} ms "
                f"({len(by[1])}), 2 threads {1e3 * statistics.median(by[2]):6.1f} ms ({len(by[2])})"
            )
    spells = report["idle_spells_s"]
    if spells:
        print(
            f"engines idle: {len(spells)} spells, median {1e3 * statistics.median(spells):.1f} ms, "
            f"longest {max(spells):.2f} s, {sum(spells):.1f} s in all"
        )
    for flag in (False, True):
        rates = [(r1, r2) for idle, r1, r2 in PROBES if idle == flag]
        if rates:
            print(
                f"torch.mm [160, {hidden}] x [{hidden}, {4 * hidden}] with the engines "
                f"{'idle' if flag else 'busy'}: {len(rates)} probes, 1 thread "
                f"{statistics.median(r for r, _ in rates):.1f} GFLOP/s, 2 threads "
                f"{statistics.median(r for _, r in rates):.1f}"
            )
    spent = cpu_by_thread([s for s in SWITCHES if s[0] >= since])
    for flag, by_thread in spent.items():
        print(f"CPU seconds, engines {'idle' if flag else 'busy'}: {describe(by_thread)}")
    report["thread_cpu"] = {"idle" if f else "busy": by for f, by in spent.items()}
    report["probes"] = PROBES
    report["idle_switches"] = [[t, flag] for t, kind, flag, _ in events if kind == "idle"]
    (args.out / "trace.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
