"""Soak: a long double-buffer run of the tiny model on two engines Orbit started, with faults
injected on a schedule, and what the run did about each (issue 20: runs that last days).

    python bench/soak.py --minutes 30                       # embedded engines, then SGLang servers
    python bench/soak.py --minutes 1 --backends embedded    # about what `make test` runs
    (tests/test_soak.py)

Faults, in turn, each waited out before the next:
- kill:      SIGKILL of one engine (a server: its whole process group);
- hang:      SIGSTOP of one engine past the pool's ping bound, SIGCONT after;
- corrupt:   a push whose adapter holds a NaN (every engine must refuse it and keep serving the
  previous
             slot; the next push goes through);
- slow-load: one adapter load 3 s slower;
- ctrl-c:    SIGINT to Orbit's process group, as a terminal sends it, then `orbit train --resume`;
- kill-save: SIGKILL of the Orbit process itself while it writes a checkpoint, then `--resume`.

Orbit runs as a child (`soak.py --child`): the orbit CLI with three hooks that only this script adds
(a corrupt snapshot, a slow load, a slow checkpoint write), armed by files the parent drops in
`<out>/control/`. The parent reads the run's timeline for when each fault was noticed and recovered
from, and samples the Orbit process's RSS, file descriptors, threads and descendants. The report:
steps done, steps lost or repeated in the final metrics.jsonl (goal 0), steps redone after a kill,
faults injected / noticed / recovered with the time to notice, RSS growth after warm-up (goal <=
5%), what was left in /dev/shm and as processes (goal: nothing), and whether peft loads the final
adapter. `--json` writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAULTS = ("kill", "hang", "corrupt", "slow-load", "ctrl-c", "kill-save")
PING_BOUND_S = 5.0  # the pool's ping timeout (orbit/engine/pool.py)
SAVE_EVERY = 4


# ---- the child: Orbit with three hooks -----------------------------------------------------------


def _take(control: Path, name: str) -> str | None:
    """The armed hook's argument, once: the rename makes exactly one caller take it."""
    path = control / name
    try:
        os.rename(path, control / f"{name}.taken-{time.time_ns()}")
    except FileNotFoundError:
        return None
    return "armed"


def child(argv: list[str]) -> None:
    control = Path(os.environ["ORBIT_SOAK_CONTROL"])
    import torch

    from orbit.cli import app
    from orbit.push import fleet, phases
    from orbit.train import checkpoint

    real_of, real_load, real_save = fleet.Snapshot.of.__func__, phases.Push._load, checkpoint.save

    def of(cls, policy, push):
        snap = real_of(cls, policy, push)
        if snap.tensors and _take(control, "corrupt"):
            name = sorted(snap.tensors)[0]
            bad = snap.tensors[name].clone()
            bad.view(-1)[0] = float("nan")
            (control / "corrupted").write_text(str(snap.version))
            snap = cls(snap.version, {**snap.tensors, name: bad}, snap.config)
        return snap

    def load(self, engine, slot, policy, timeline):
        if _take(control, "slow-load"):
            time.sleep(3.0)
        return real_load(self, engine, slot, policy, timeline)

    def save(run_dir, version, write, keep_last):
        def slow_write(directory):
            write(directory)
            if _take(control, "slow-save"):
                (control / "saving").write_text(str(version))
                time.sleep(60)  # killed here by the parent

        return real_save(run_dir, version, slow_write, keep_last)

    fleet.Snapshot.of = classmethod(of)
    phases.Push._load = load
    checkpoint.save = save
    torch.set_num_threads(1)
    app(argv, prog_name="orbit")


# ---- the parent ----------------------------------------------------------------------------------


@dataclass
class Fault:
    kind: str
    t: float  # when it was injected (time.time())
    # until the run showed it saw it (a lost engine, a refusal, an exit)
    noticed_s: float | None = None
    recovered_s: float | None = None  # until it served again (rejoined, a later version, resumed)
    detail: str = ""


@dataclass
class Report:
    backend: str
    minutes: float
    steps: int = 0
    steps_lost: int = 0
    steps_repeated: int = 0
    steps_redone: int = 0
    starts: int = 0
    faults: list[Fault] = field(default_factory=list)
    # per Orbit process: [warm, end] pairs flattened
    rss_mb: list[float] = field(default_factory=list)
    rss_growth: float | None = None
    fds: tuple[int, int] = (0, 0)  # min, max over the run
    threads: tuple[int, int] = (0, 0)
    descendants: tuple[int, int] = (0, 0)
    shm_left: list[str] = field(default_factory=list)
    processes_left: list[str] = field(default_factory=list)
    adapter_loads: bool = False


def recipe(out: Path, model: Path, backend: str) -> Path:
    import yaml

    data = {
        "model": str(model),
        "mode": "double-buffer",
        "max_staleness": 2,
        "seed": 0,
        "out": str(out / "run"),
        "adapter": {"type": "lora", "r": 4, "alpha": 8},
        "engine": {
            "backend": backend,
            "replicas": 2,
            "max_inflight": 16,
            "max_running": 16,
            "restarts": 5,
        },
        "rollout": {
            "group_size": 4,
            "prompts_per_step": 2,
            "max_new_tokens": 12,
            "stall_timeout_s": 180,
        },
        "trainer": {"lr": 0.01, "steps": 1_000_000, "save_every": SAVE_EVERY, "keep_last": 3},
        # the loss its recorded figures were measured with; faults, not the algorithm, are the test
        "algorithm": {"preset": "orbit_v1"},
    }
    path = out / f"recipe-{backend}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


class Orbit:
    """One `orbit train` child, its output in a log, its process sampled."""

    def __init__(self, recipe: Path, out: Path, resume: bool, report: Report) -> None:
        import psutil

        args = ["train", str(recipe), "--quiet"] + (
            ["--resume", str(out / "run")] if resume else []
        )
        env = {**os.environ, "ORBIT_SOAK_CONTROL": str(out / "control"), "PYTHONPATH": str(ROOT)}
        self.log = open(out / "orbit.log", "a")  # noqa: SIM115 - closed in wait()
        self.log.write(f"\n=== orbit {' '.join(args)}\n")
        self.log.flush()
        self.popen = subprocess.Popen(
            [sys.executable, __file__, "--child", *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.proc = psutil.Process(self.popen.pid)
        self.report, self.started = report, time.time()
        self.rss: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        import psutil

        r = self.report
        while not self._stop.wait(2.0):
            try:
                with self.proc.oneshot():
                    rss, fds = self.proc.memory_info().rss / 2**20, self.proc.num_fds()
                    threads = self.proc.num_threads()
                kids = len(self.proc.children(recursive=True))
            except psutil.Error:
                return
            self.rss.append((time.time() - self.started, rss))
            r.fds = (min(r.fds[0] or fds, fds), max(r.fds[1], fds))
            r.threads = (min(r.threads[0] or threads, threads), max(r.threads[1], threads))
            r.descendants = (min(r.descendants[0] or kids, kids), max(r.descendants[1], kids))

    def engines(self) -> list[int]:
        """The engine roots: embedded engine processes (forked from Orbit's fork server, named
        orbit-engine), or started servers' launchers (Orbit's own children)."""
        import psutil

        pids = []
        for p in self.proc.children(recursive=True):
            try:
                engine = p.name() == "orbit-engine" and p.status() != psutil.STATUS_ZOMBIE
                launcher = p.ppid() == self.proc.pid and "launch.py" in " ".join(p.cmdline())
            except psutil.Error:
                continue
            if engine or launcher:
                pids.append(p.pid)
        return pids

    def descendants(self) -> list:
        import psutil

        try:
            return self.proc.children(recursive=True)
        except psutil.Error:
            return []

    def wait(self, seconds: float) -> int | None:
        try:
            code = self.popen.wait(seconds)
        except subprocess.TimeoutExpired:
            return None
        self._stop.set()
        self._sampler.join()
        self.log.close()
        # after warm-up: engines started, first steps taken
        warm = [mb for t, mb in self.rss if t > 60]
        if len(warm) >= 10:
            self.report.rss_mb += [round(min(warm[:5]), 1), round(max(warm[-5:]), 1)]
        return code


def timeline(out: Path) -> list[dict]:
    path = out / "run" / "timeline.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def steps(out: Path) -> list[int]:
    path = out / "run" / "metrics.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(line)["step"] for line in text[: text.rfind("\n") + 1].splitlines()]


def until(check, seconds: float, poll: float = 0.5):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if (value := check()) is not None:
            return value
        time.sleep(poll)
    return None


def event_after(out: Path, t: float, kind: str, **match) -> dict | None:
    for e in timeline(out):
        if e["kind"] == kind and e["t0"] >= t and all(e.get(k) == v for k, v in match.items()):
            return e
    return None


def engine_fault(orbit: Orbit, out: Path, fault: Fault, hang: bool) -> None:
    pids = until(lambda: orbit.engines() or None, 60)
    if not pids:
        fault.detail = "no engine process found"
        return
    pid = pids[0]
    group = os.getpgid(pid) if os.getpgid(pid) != os.getpgid(orbit.popen.pid) else None
    sig = signal.SIGSTOP if hang else signal.SIGKILL
    fault.t = time.time()
    os.killpg(group, sig) if group else os.kill(pid, sig)
    lost = until(lambda: event_after(out, fault.t, "lost"), PING_BOUND_S + 60)
    if hang:
        time.sleep(max(0.0, PING_BOUND_S + 3 - (time.time() - fault.t)))
        try:
            os.killpg(group, signal.SIGCONT) if group else os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass  # the pool killed it meanwhile, as it should
    if lost is None:
        return
    fault.noticed_s, fault.detail = lost["t0"] - fault.t, lost.get("reason", "")
    back = until(lambda: event_after(out, lost["t0"], "rejoined", engine=lost["engine"]), 240)
    if back is not None:
        fault.recovered_s = back["t0"] - fault.t


def push_fault(out: Path, fault: Fault, name: str) -> None:
    control = out / "control"
    fault.t = time.time()
    (control / name).write_text("")
    if name == "corrupt":
        version = until(
            lambda: int(p.read_text()) if (p := control / "corrupted").exists() else None, 120
        )
        if version is None:
            return
        (control / "corrupted").unlink()
        refused = until(lambda: event_after(out, fault.t, "refused", version=version), 60)
        if refused is not None:
            fault.noticed_s, fault.detail = refused["t0"] - fault.t, refused.get("reason", "")[:80]
        later = until(lambda: event_after(out, fault.t, "update", version=version + 1), 120)
    # a load that takes 3 s longer: noticed when the hook fires, recovered once a load after it ends
    else:
        taken = until(lambda: None if (control / name).exists() else time.time(), 120)
        if taken is None:
            return
        fault.noticed_s = taken - fault.t
        later = until(
            lambda: next(
                (e for e in timeline(out) if e["kind"] == "update" and e["t1"] > taken + 3), None
            ),
            120,
        )
    if later is not None:
        fault.recovered_s = later["t1"] - fault.t


def restart_fault(
    orbit: Orbit, out: Path, fault: Fault, recipe_path: Path, report: Report
) -> Orbit:
    """Ctrl-C (the group, as a terminal) or SIGKILL of Orbit mid-save; then --resume."""
    control = out / "control"
    started = orbit.descendants()
    if fault.kind == "kill-save":
        (control / "slow-save").write_text("")
        saving = until(lambda: (control / "saving").exists() or None, 180)
        fault.t = time.time()
        if saving is None:
            fault.detail = "no save began"
        os.kill(orbit.popen.pid, signal.SIGKILL)
    else:
        fault.t = time.time()
        os.killpg(orbit.popen.pid, signal.SIGINT)
    code = orbit.wait(120)
    if code is None:
        fault.detail = "Orbit did not exit within 120 s"
        os.killpg(orbit.popen.pid, signal.SIGKILL)
        orbit.wait(30)
    fault.noticed_s = time.time() - fault.t
    # nothing outlives Orbit
    if until(lambda: None if any(_alive(p) for p in started) else True, 30) is None:
        report.processes_left.append(f"after {fault.kind}: {[p.pid for p in started if _alive(p)]}")
    (control / "saving").unlink(missing_ok=True)
    nxt = Orbit(recipe_path, out, resume=True, report=report)
    report.starts += 1
    resumed = until(lambda: _resumed_at(out), 120)
    if resumed is not None:
        if until(lambda: len(steps(out)) > resumed or None, 300):
            fault.recovered_s = time.time() - fault.t
    fault.detail += f" exit {code}"
    return nxt


def _alive(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _resumed_at(out: Path) -> int | None:
    """The step the newest `orbit train --resume` continued from (its first line says)."""
    import re

    text = (out / "orbit.log").read_text()
    last = text[text.rfind("=== orbit") :]
    if "from the start" in last:
        return 0
    found = re.search(r"resuming .*? \(step (\d+)\)", last, re.S)  # rich may wrap the line
    return int(found.group(1)) if found else None


def soak(backend: str, minutes: float, out: Path, model: Path) -> Report:
    report = Report(backend, minutes)
    out.mkdir(parents=True, exist_ok=True)
    (out / "control").mkdir(exist_ok=True)
    shm_before = set(os.listdir("/dev/shm"))
    path = recipe(out, model, backend)
    orbit = Orbit(path, out, resume=False, report=report)
    report.starts = 1
    deadline = time.time() + minutes * 60
    until(lambda: len(steps(out)) >= 2 or None, 300)
    i = 0
    while time.time() < deadline or i < len(FAULTS):  # every fault at least once
        fault = Fault(FAULTS[i % len(FAULTS)], time.time())
        report.faults.append(fault)
        if fault.kind in ("kill", "hang"):
            engine_fault(orbit, out, fault, hang=fault.kind == "hang")
        elif fault.kind in ("corrupt", "slow-load"):
            push_fault(out, fault, fault.kind)
        else:
            orbit = restart_fault(orbit, out, fault, path, report)
        print(
            f"  {backend}: {fault.kind:9s} noticed {_s(fault.noticed_s)} recovered "
            f"{_s(fault.recovered_s)} {fault.detail[:70]}",
            flush=True,
        )
        i += 1
        # let it run a while between faults
        until(lambda: None, 1 if minutes < 2 else 3 if minutes < 10 else 15)
    started = orbit.descendants()
    os.killpg(orbit.popen.pid, signal.SIGINT)  # the end: Ctrl-C saves the last step
    if orbit.wait(120) is None:
        os.killpg(orbit.popen.pid, signal.SIGKILL)
        orbit.wait(30)
        report.processes_left.append("Orbit did not stop within 120 s of the final Ctrl-C")
    if until(lambda: None if any(_alive(p) for p in started) else True, 30) is None:
        report.processes_left.append(f"after the end: {[p.pid for p in started if _alive(p)]}")
    done = steps(out)
    report.steps = len(done)
    report.steps_lost = len(set(range(max(done, default=-1) + 1)) - set(done))
    report.steps_repeated = len(done) - len(set(done))
    # lines past the checkpoint a resume went back to
    discarded = out / "run" / "metrics.discarded.jsonl"
    report.steps_redone = len(discarded.read_text().splitlines()) if discarded.exists() else 0
    time.sleep(1)
    report.shm_left = sorted(set(os.listdir("/dev/shm")) - shm_before)
    if report.rss_mb:
        pairs = list(zip(report.rss_mb[::2], report.rss_mb[1::2], strict=True))
        report.rss_growth = round(max(end / warm - 1 for warm, end in pairs), 4)
    report.adapter_loads = peft_loads(model, out / "run" / "adapter")
    return report


def peft_loads(model: Path, adapter: Path) -> bool:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    try:
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), adapter)
        with torch.no_grad():
            logits = peft_model(torch.tensor([[1, 2, 3]])).logits
        return bool(torch.isfinite(logits).all())
    except Exception as err:  # noqa: BLE001 - reported as the answer
        print(f"  peft could not load {adapter}: {err}")
        return False


def _s(v: float | None) -> str:
    return "  never" if v is None else f"{v:6.1f}s"


def table(r: Report) -> str:
    lines = [
        f"soak on {r.backend}, {r.minutes:g} min: {r.steps} steps in {r.starts} Orbit starts; lost "
        f"{r.steps_lost}, repeated {r.steps_repeated}, redone after a kill {r.steps_redone}",
        f"  {'fault':10s} {'injected':>8s} {'noticed':>8s} {'recovered':>9s} "
        f"{'notice (median/max)':>20s}",
    ]
    for kind in FAULTS:
        fs = [f for f in r.faults if f.kind == kind]
        seen = sorted(f.noticed_s for f in fs if f.noticed_s is not None)
        back = sum(f.recovered_s is not None for f in fs)
        spread = f"{seen[len(seen) // 2]:.1f} / {seen[-1]:.1f} s" if seen else "-"
        lines.append(f"  {kind:10s} {len(fs):8d} {len(seen):8d} {back:9d} {spread:>20s}")
    growth = "-" if r.rss_growth is None else f"{100 * r.rss_growth:+.1f}%"
    lines += [
        f"  Orbit RSS after warm-up -> end (MB, per start): {r.rss_mb}, largest growth {growth}",
        f"  fds {r.fds[0]}..{r.fds[1]}, threads {r.threads[0]}..{r.threads[1]}, descendants "
        f"{r.descendants[0]}..{r.descendants[1]}",
        f"  /dev/shm entries left: {len(r.shm_left)} {r.shm_left[:5]}; processes left: "
        f"{r.processes_left or 0}",
        f"  the final adapter loads with peft: {r.adapter_loads}",
    ]
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--minutes", type=float, default=30.0, help="in all, split between the backends"
    )
    parser.add_argument("--backends", default="embedded,sglang-server")
    parser.add_argument("--model", type=Path, default=ROOT / ".cache" / "tiny" / "llama-s0")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "soak")
    parser.add_argument("--json", type=Path, default=None, help="write the reports here")
    args = parser.parse_args()
    if not (args.model / "model.safetensors").exists():
        from orbit.models.tiny import build_tiny_model

        build_tiny_model(args.model, arch="llama", seed=0)
    backends = args.backends.split(",")
    reports = []
    for backend in backends:
        out = args.out / backend
        if out.exists():
            import shutil

            shutil.rmtree(out)
        print(f"soak: {backend} for {args.minutes / len(backends):g} min -> {out}", flush=True)
        reports.append(soak(backend, args.minutes / len(backends), out, args.model))
        print(table(reports[-1]), flush=True)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in reports], indent=1))


if __name__ == "__main__":
    main()
