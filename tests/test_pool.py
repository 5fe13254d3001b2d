"""Many engines: every mode on two embedded engines, independent flips vs a barrier with one slow
engine, an engine killed mid-run, all engines killed, staleness bounds across engines."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

import psutil
import pytest
import yaml
from admission import run_ahead
from run_helpers import (
    check_no_request_ran_on_a_slot_being_written,
    checked,
    engine_processes,
    recipe_dict,
    run_metrics,
    run_timeline,
)
from straggler import Slowing, slowed

from orbit.config.modes import MODE_NAMES, MODES
from orbit.engine.base import SamplingParams
from orbit.run.lifecycle import train

pytestmark = pytest.mark.slow  # end-to-end: `make test-fast` leaves it out


def _recipe(model: Path, out: Path, **patch) -> dict:
    return recipe_dict(
        model,
        out,
        {
            "engine": {"max_inflight": 12, "max_running": 12, "replicas": 2},
            "rollout": {"max_new_tokens": 16},
            "trainer": {"steps": 4},
        },
        **patch,
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", MODE_NAMES)
def test_every_mode_trains_on_two_engines(tmp_path, tiny_llama, mode):
    recipe = checked(
        _recipe(tiny_llama, tmp_path / "run", mode=mode, max_staleness=1, engine={"slots": 3})
    )
    assert train(recipe, live=False).steps_done == 4
    rows = run_metrics(tmp_path / "run")
    assert all(r["engines_alive"] == 2 for r in rows)
    events = run_timeline(tmp_path / "run")
    requests = [e for e in events if e["kind"] == "request" and e["finish"] != "abort"]
    assert {e["engine"] for e in requests} == {0, 1}, "both engines generate"
    check_no_request_ran_on_a_slot_being_written(events, retract_ok=MODES[mode].push == "adapter")
    if mode.startswith("sync"):
        # every engine took the version before the batch
        assert all(r["staleness_max"] == 0 for r in rows)
    else:
        assert all(r["staleness_max"] <= 1 for r in rows)
    lags = [r["flip_lag_s"] for r in rows if r["flip_lag_s"] is not None]
    assert lags and max(lags) < sum(r["step_s"] for r in rows)  # measured, and a lag within the run
    assert rows[0]["logprob_diff"] is not None and rows[0]["logprob_diff"] < 1e-3


@pytest.mark.alone  # a time bound: no other test beside it
@pytest.mark.timeout(300)
def test_a_slow_engine_holds_nobody_with_independent_flips_and_everybody_with_a_barrier(
    tmp_path, tiny_llama, monkeypatch, capsys
):
    """Engine 1 takes 0.6 s longer for every load. Independent: the trainer's push costs the
    snapshot only, engine 0 flips every step, engine 1 skips to the newest version it can. Barrier:
    every push waits for the slow engine."""
    figures = {}
    for flip in ("independent", "barrier"):
        run_dir = tmp_path / flip
        train(
            checked(
                _recipe(
                    tiny_llama,
                    run_dir,
                    mode="double-buffer",
                    max_staleness=2,
                    engine={"flip": flip, "slots": 4},
                    trainer={"steps": 8},
                )
            ),
            live=False,
            engines=slowed(Slowing(load_s=0.6)),
        )
        rows = run_metrics(run_dir)
        loads = [e for e in run_timeline(run_dir) if e["kind"] == "load_adapter"]
        figures[flip] = {
            "update_weights_s": median(r["update_weights_s"] for r in rows),
            "step_s": median(r["step_s"] for r in rows),
            # None when the slow engine's first flip outlasts the whole run (tiny steps): printed,
            # not checked
            "flip_lag_s": median(lags)
            if (lags := [r["flip_lag_s"] for r in rows if r["flip_lag_s"] is not None])
            else None,
            "loads": [sum(e["engine"] == i for e in loads) for i in (0, 1)],
        }
    with capsys.disabled():
        print(f"\nslow engine (0.6 s per load), medians: {figures}")
    independent, barrier = figures["independent"], figures["barrier"]
    assert independent["update_weights_s"] < 0.1, independent  # the snapshot, not the slow load
    assert independent["loads"][0] == 8  # the fast engine flipped every step
    # everyone waited for it
    assert barrier["update_weights_s"] >= 0.6 and barrier["loads"] == [8, 8]


@pytest.mark.timeout(300)
def test_an_engine_killed_mid_run_leaves_the_pool_and_the_run_finishes_on_the_other(
    tmp_path, tiny_llama
):
    run_dir, proc = _train_on_the_command_line(
        tmp_path, tiny_llama, steps=40, engine={"restarts": 0}
    )
    try:
        _wait(lambda: (run_dir / "metrics.jsonl").exists() and len(run_metrics(run_dir)) >= 3)
        engines = _engine_processes(proc.pid)
        assert len(engines) == 2
        engines[1].send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    rows = run_metrics(run_dir)
    assert len(rows) == 40 and rows[0]["engines_alive"] == 2 and rows[-1]["engines_alive"] == 1
    log = (run_dir / "run.log").read_text()
    assert "WARNING engine" in log and "left the pool" in log and "1 engine(s) left" in log
    assert "left the pool" in " ".join(out.split())  # said on the console too
    later = [
        e for e in run_timeline(run_dir) if e["kind"] == "request" and e["t0"] > _lost_at(run_dir)
    ]
    assert later and all(e["engine"] != _lost_engine(run_dir) for e in later)


@pytest.mark.timeout(300)
def test_a_started_engine_that_dies_or_hangs_is_restarted_and_rejoins(tmp_path, tiny_llama):
    """The only engine is SIGKILLed, then its successor SIGSTOPped: each time the pool holds the
    requests, the engine is started again, brought to the newest version and rejoins; no step is
    lost."""
    run_dir, proc = _train_on_the_command_line(
        tmp_path, tiny_llama, steps=30, engine={"replicas": 1}
    )
    try:
        _wait(lambda: (run_dir / "metrics.jsonl").exists() and len(run_metrics(run_dir)) >= 3)
        [first] = _engine_processes(proc.pid)
        first.send_signal(signal.SIGKILL)
        _wait(
            lambda: (
                [e.pid for e in _engine_processes(proc.pid) if e.pid != first.pid]
                and run_metrics(run_dir)[-1]["rejoined"] == 1
            )
        )
        [second] = [e for e in _engine_processes(proc.pid) if e.pid != first.pid]
        second.send_signal(signal.SIGSTOP)  # hung: alive but silent
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    rows = run_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(30)) and rows[-1]["rejoined"] == 2
    assert rows[-1]["engines_alive"] == 1
    log = (run_dir / "run.log").read_text()
    assert "engine 0 left the pool: engine process" in log and "bringing it back" in log
    assert (
        "neither answered nor made progress for" in log
        and "(hung)" in log
        and log.count("engine 0 rejoined the pool at v") == 2
    )
    assert _gone(second.pid)  # the hung one was killed, by its id


@pytest.mark.alone  # a time bound: no other test beside it
@pytest.mark.timeout(180)
def test_all_engines_killed_is_a_clear_error_with_the_adapter_saved(tmp_path, tiny_llama):
    run_dir = tmp_path / "run"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        yaml.safe_dump(
            _recipe(
                tiny_llama,
                run_dir,
                mode="double-buffer",
                trainer={"steps": 500},
                engine={"restarts": 0},
            )
        )
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "orbit.cli", "train", str(recipe), "--quiet"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait(lambda: (run_dir / "metrics.jsonl").exists() and len(run_metrics(run_dir)) >= 3)
        engines = _engine_processes(proc.pid)
        killed = time.monotonic()
        for e in engines:
            e.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - killed
    finally:
        proc.kill()
    flat = " ".join(err.split())
    assert proc.returncode == 1 and "the engine died" in flat and "no engine left" in flat, err
    assert "Traceback" not in err and took < 5
    state = yaml.safe_load((run_dir / "adapter" / "trainer_state.json").read_text())
    assert state["version"] == run_metrics(run_dir)[-1]["version"] >= 3


@pytest.mark.timeout(300)
@pytest.mark.parametrize("k", [0, 1])
def test_staleness_bounds_hold_across_engines_and_drops_are_replaced(tmp_path, tiny_llama, k):
    """Two engines, the former run-ahead admission (so that groups do go stale): the bound holds on
    every step, drops happen and are replaced, nothing hangs (the test timeout)."""
    run_dir = tmp_path / "run"
    with run_ahead():
        train(
            checked(
                _recipe(
                    tiny_llama,
                    run_dir,
                    mode="async-adapter",
                    max_staleness=k,
                    trainer={"steps": 6},
                    rollout={"max_new_tokens": 24},
                )
            ),
            live=False,
        )
    rows = run_metrics(run_dir)
    assert len(rows) == 6 and all(r["staleness_max"] <= k for r in rows)
    assert sum(r["stale_dropped"] for r in rows) > 0


def test_the_pool_routes_to_the_least_loaded_and_keeps_an_episode_on_its_engine(tiny_llama):
    from orbit.engine.embedded import start_embedded_engine
    from orbit.engine.pool import EnginePool

    long = SamplingParams(max_new_tokens=60, ignore_eos=True, seed=1)
    with EnginePool(
        [start_embedded_engine(tiny_llama, max_running=4) for _ in range(2)], [4, 4]
    ) as pool:
        futs = [pool.generate([5, 6, 7], long) for _ in range(6)]
        assert sorted(f.result(60).engine for f in futs) == [0, 0, 0, 1, 1, 1]
        pinned = [pool.generate([5, 6, 7], long, engine=1) for _ in range(3)]
        assert {f.result(60).engine for f in pinned} == {1}
        assert pool.pick(min_version=1) is None and pool.pick(min_version=0) in (0, 1)


# ---- helpers ------------------------------------------------------------------------------------


def _wait(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def _gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def _engine_processes(pid: int) -> list[psutil.Process]:
    return engine_processes(psutil.Process(pid))


def _train_on_the_command_line(
    tmp_path: Path, model: Path, steps: int, engine: dict
) -> tuple[Path, subprocess.Popen]:
    """`orbit train` of a double-buffer recipe in a process of its own: its run directory and the
    process."""
    run_dir = tmp_path / "run"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        yaml.safe_dump(
            _recipe(model, run_dir, mode="double-buffer", trainer={"steps": steps}, engine=engine)
        )
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "orbit.cli", "train", str(recipe), "--quiet"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return run_dir, proc


def _lost(run_dir: Path) -> dict:
    return next(e for e in run_timeline(run_dir) if e["kind"] == "lost")


def _lost_at(run_dir: Path) -> float:
    return _lost(run_dir)["t0"]


def _lost_engine(run_dir: Path) -> int:
    return _lost(run_dir)["engine"]
