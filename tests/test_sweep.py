"""`orbit sweep`: K adapters trained at once on one base, one engine and one trainer (orbit/sweep/),
each a whole run of its own. The SGLang sweeps are in tests/test_sglang_modes.py."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from run_helpers import checked, recipe_dict, run_metrics, run_timeline
from safetensors.torch import load_file

from orbit.config import RecipeError, load_recipe
from orbit.engine import start_engine
from orbit.engine.base import SamplingParams
from orbit.run.lifecycle import train
from orbit.sweep.plan import plan_sweep, preflight_sweep
from orbit.sweep.run import sweep

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SWEEP = {"engine": {"max_inflight": 8, "max_running": 32}, "max_staleness": 1}


def _plan(
    tmp_path: Path,
    model: Path,
    runs: list | None = None,
    vary: list[str] | None = None,
    overrides: dict | None = None,
    **patch,
):
    data = recipe_dict(model, tmp_path / "sweep", SWEEP, **patch)
    if runs is not None:
        data["runs"] = runs
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(data))
    return preflight_sweep(plan_sweep(path, vary or [], overrides))[0]


@pytest.mark.parametrize(
    ("runs", "vary", "patch", "message"),
    [
        (
            None,
            ["engine.max_running=8,16"],
            {},
            "engine.max_running: the runs of a sweep share the base model",
        ),
        (None, ["model=a,b"], {}, "model: the runs of a sweep share"),
        (
            None,
            ["trainer.lr=1e-3,2e-3"],
            {"mode": "sync"},
            "mode: a sweep trains each adapter double-buffered",
        ),
        (None, ["trainer.lr=1e-3"], {}, "a sweep needs at least 2 runs"),
        (None, ["trainer.lr"], {}, "--vary 'trainer.lr': write KEY=V1,V2"),
        (
            None,
            ["seed=" + ",".join(map(str, range(33)))],
            {},
            "engine.slots: 33 runs × 2 slots each = 66",
        ),
        (
            [{"trainer": {"lr": -1}}, {}],
            None,
            {},
            "runs[0] (lr=-1): trainer.lr: Input should be greater than or equal",
        ),
        ([{"name": "a"}, {"name": "a", "seed": 3}], None, {}, "two runs would share the directory"),
        ([{"seed": 1}, {"seed": 2}], ["seed=3,4"], {}, "leave out --vary, or the runs: list"),
        (
            None,
            ["seed=1,2"],
            {"trainer": {"devices": ["cpu", "cpu"]}},
            "trainer.devices: a sweep's adapters share one",
        ),
        (
            [{"name": "ok"}, {"name": "bad", "task": {"name": "tests/user_tasks.py:no_such"}}],
            None,
            {},
            "bad: task.name",
        ),
    ],
)
def test_a_bad_sweep_fails_before_any_compute_naming_the_run_and_field(
    tmp_path, tiny_llama, runs, vary, patch, message
):
    with pytest.raises(RecipeError) as err:
        _plan(tmp_path, tiny_llama, runs, vary, **patch)
    assert message in " ".join(str(err.value).split())
    assert not (tmp_path / "sweep").exists()


def test_orbit_train_on_a_sweep_recipe_says_to_run_it_with_orbit_sweep(tmp_path, tiny_llama):
    path = tmp_path / "r.yaml"
    path.write_text(
        yaml.safe_dump(recipe_dict(tiny_llama, tmp_path / "run", runs=[{"seed": 1}, {"seed": 2}]))
    )
    with pytest.raises(
        RecipeError, match="lists the runs of a sweep; start it with `orbit sweep RECIPE`"
    ):
        load_recipe(path)


def _adapter(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / f"step-{step:06d}" / "adapter_model.safetensors")


def _saved(run_dir: Path) -> int:
    """The step of the checkpoint `adapter` points at."""
    return int((run_dir / "adapter").resolve().name.removeprefix("step-"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_sweep_trains_each_adapter_on_its_own_slots_and_a_failing_run_stops_alone(
    tmp_path, tiny_llama
):
    runs = [
        {"name": "control", "trainer": {"lr": 0.0}},
        {"name": "learns", "trainer": {"lr": 0.02}},
        {"name": "breaks", "task": {"name": "tests/user_tasks.py:broken_scorer", "fail_after": 40}},
        {"name": "nan", "task": {"name": "tests/user_tasks.py:nan_reward", "fail_after": 56}},
    ]
    plan = _plan(
        tmp_path, tiny_llama, runs, trainer={"steps": 8, "save_every": 1, "keep_last": 100}
    )
    result = sweep(plan, live=False)
    state = {s.name: (s.state, s.reason) for s in result.statuses}
    assert state["control"] == ("done", "") and state["learns"] == ("done", "")
    # each failing run (its task raising; its reward NaN, so its loss) stopped alone, saved, and its
    # directory and the console say why
    assert state["breaks"][0] == "stopped" and "verifier crashed" in state["breaks"][1], state
    assert state["nan"][0] == "stopped" and "non-finite gradient norm" in state["nan"][1], state
    for name, why in (("breaks", "verifier crashed"), ("nan", "non-finite gradient norm")):
        broken = tmp_path / "sweep" / name
        assert why in (broken / "run.log").read_text()
        rows = run_metrics(broken)
        assert 0 < len(rows) < 8 and _saved(broken) == rows[-1]["version"], name

    for i, name in enumerate(("control", "learns", "breaks", "nan")):
        run_dir = tmp_path / "sweep" / name
        rows = run_metrics(run_dir)
        assert all(r["logprob_diff"] is not None and r["logprob_diff"] < 1e-4 for r in rows), name
        requests = [e for e in run_timeline(run_dir) if e["kind"] == "request"]
        # each request names its run and the engine slot it ran on: the run's own two
        assert requests and {e["adapter"] for e in requests} == {name}
        assert {e["slot"] for e in requests} <= {2 * i, 2 * i + 1}, name
    assert len(run_metrics(tmp_path / "sweep" / "learns")) == 8
    # the runs share the engine at once, not one after another: their requests' periods overlap.
    # (Whether two given requests overlap is chance: each run's 8 requests of a step take ~20 ms of
    # a ~300 ms step. That the engine batches rows of different slots together, each with its own
    # adapter, is tests/test_engine_numerics.py's test_mixed_batch_rows_match_alone.) By design:
    # control's producer starts before learns' run is built, and control's last step's requests wait
    # for its loop, which starts once every run is built.
    periods = {}
    for name in ("control", "learns"):
        spans = [e for e in run_timeline(tmp_path / "sweep" / name) if e["kind"] == "request"]
        periods[name] = (min(e["t0"] for e in spans), max(e["t1"] for e in spans))
    (c0, c1), (l0, l1) = periods["control"], periods["learns"]
    assert c0 < l1 and l0 < c1, periods

    # lr 0: the adapter never moves (LoRA's B stays 0), step after step ...
    control = tmp_path / "sweep" / "control"
    first = _adapter(control, 1)
    assert all(not t.any() for k, t in first.items() if "lora_B" in k)
    for step in range(2, 9):
        assert all(torch.equal(first[k], t) for k, t in _adapter(control, step).items())
    assert not all(
        torch.equal(first[k], t) for k, t in _adapter(tmp_path / "sweep" / "learns", 8).items()
    )
    # ... and an engine serving it gives the base model's logprobs exactly
    engine = start_engine(plan.recipe.engine, tiny_llama, seed=0)
    try:
        import json

        config = json.loads((control / "adapter" / "adapter_config.json").read_text())
        engine.load_adapter(
            0, load_file(control / "adapter" / "adapter_model.safetensors"), config, version=8
        )
        greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
        for prompt in ([5, 9, 11], [3, 3, 8, 2]):
            adapted = engine.generate(prompt, greedy, slot=0).result(60)
            base = engine.generate(prompt, greedy, slot=None).result(60)
            assert adapted.output_ids == base.output_ids and adapted.logprobs == base.logprobs
    finally:
        engine.shutdown()

    # the sweep's summary, and each run's directory is a run like any other: it resumes alone
    assert (tmp_path / "sweep" / "summary.json").exists() and (
        tmp_path / "sweep" / "reward.png"
    ).exists()
    learns = tmp_path / "sweep" / "learns"
    again = load_recipe(learns / "recipe.yaml", {"trainer.steps": 10})
    train(checked(again.model_dump(mode="json")), resume=True, live=False)
    assert [r["step"] for r in run_metrics(learns)] == list(range(10))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ctrl_c_stops_every_run_saved_and_the_sweep_resumes(tmp_path, tiny_llama):
    plan = _plan(
        tmp_path,
        tiny_llama,
        vary=["trainer.lr=0.01,0.02"],
        trainer={"steps": 500, "save_every": 1000},
    )
    dirs = [r.run_dir for r in plan.runs]

    def interrupt() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(len(_lines(d)) >= 2 for d in dirs):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    killer = threading.Thread(target=interrupt, daemon=True)
    killer.start()
    result = sweep(plan, live=False)
    killer.join()
    assert result.interrupted and {s.state for s in result.statuses} == {"interrupted"}
    saved = []
    for run_dir in dirs:
        rows = run_metrics(run_dir)
        assert _saved(run_dir) == rows[-1]["version"] == len(rows)
        saved.append(len(rows))
    # every run goes on from its own checkpoint to the new last step
    plan = _plan(
        tmp_path, tiny_llama, vary=["trainer.lr=0.01,0.02"], trainer={"steps": max(saved) + 2}
    )
    result = sweep(plan, resume=True, live=False)
    assert {s.state for s in result.statuses} == {"done"}
    for run_dir in dirs:
        assert [r["step"] for r in run_metrics(run_dir)] == list(range(max(saved) + 2))


@pytest.mark.alone  # a time bound: no other test beside it
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_slow_task_does_not_hold_back_a_fast_one(tmp_path, tiny_llama):
    """The trainer takes whichever run's batch is complete first: a run whose verifier takes 0.25 s
    a sample (2 s a batch of 8) does not hold back the run beside it."""
    runs = [
        {
            "name": "slow",
            "trainer": {"steps": 3},
            "task": {"name": "tests/user_tasks.py:slow_scorer", "delay_s": 0.25},
        },
        {"name": "fast", "trainer": {"steps": 6}},
    ]
    sweep(_plan(tmp_path, tiny_llama, runs), live=False)
    trained = {
        name: [e["t1"] for e in run_timeline(tmp_path / "sweep" / name) if e["kind"] == "train"]
        for name in ("slow", "fast")
    }
    assert len(trained["slow"]) == 3 and len(trained["fast"]) == 6
    # the fast run finished its 6 steps before the slow one finished its second (>= 4 s of scoring)
    assert trained["fast"][-1] < trained["slow"][1], trained
    fast = run_metrics(tmp_path / "sweep" / "fast")
    assert max(r["trainer_queue_s"] for r in fast) < 1.0  # it never waited long for the trainer


def _lines(run_dir: Path) -> list[str]:
    path = run_dir / "metrics.jsonl"
    return path.read_text().splitlines() if path.exists() else []


def test_resuming_a_sweep_that_never_stepped_says_so(tmp_path, tiny_llama):
    plan = _plan(tmp_path, tiny_llama, vary=["seed=1,2"])
    with pytest.raises(RecipeError, match="no run of this sweep in .* completed a step"):
        sweep(plan, resume=True, live=False)


def test_the_live_table_shows_each_run_and_why_one_stopped(tmp_path):
    from rich.console import Console

    from orbit.metrics.steps import StepMetrics
    from orbit.sweep.watch import RunStatus, SweepTable

    statuses = [RunStatus("lr=0.01", tmp_path, 10), RunStatus("lr=0.02", tmp_path, 10)]
    statuses[0].stepped(
        StepMetrics(
            mode="double-buffer",
            step=2,
            version=3,
            update_weights_s=0.0,
            train_wait_s=0.1,
            rollout_tok_per_dev_s=1.0,
            step_s=0.5,
            staleness_mean=0.75,
            staleness_max=1,
            engine_paused_s=0.0,
            logprob_diff=1e-7,
            reward_mean=0.25,
            loss=0.1,
            stale_dropped=0,
            trained_tokens=100,
            trainer_queue_s=0.2,
        )
    )
    statuses[1].end("stopped", "the task failed: verifier crashed\nthe run stopped after step 4")
    console = Console(record=True, width=200)
    console.print(SweepTable(statuses, enabled=False)._render())
    text = console.export_text()
    # 100 tokens / 0.5 s
    assert "lr=0.01" in text and "3/10" in text and "0.250" in text and "200" in text
    assert "stopped: the task failed: verifier crashed" in text and "after step 4" not in text


def test_recipe_check_checks_every_run_of_a_sweep(tmp_path, tiny_llama):
    from typer.testing import CliRunner

    from orbit.cli import app

    path = tmp_path / "r.yaml"
    path.write_text(
        yaml.safe_dump(
            recipe_dict(tiny_llama, tmp_path / "sweep", runs=[{"name": "a"}, {"seed": 2}])
        )
    )
    res = CliRunner().invoke(app, ["recipe", "check", str(path)])
    assert res.exit_code == 0 and "a sweep of 2 runs: a, seed=2" in " ".join(res.output.split()), (
        res.output
    )
    path.write_text(
        yaml.safe_dump(
            recipe_dict(
                tiny_llama,
                tmp_path / "sweep",
                runs=[{"name": "a"}, {"name": "b", "rollout": {"group_size": 0}}],
            )
        )
    )
    res = CliRunner().invoke(app, ["recipe", "check", str(path)])
    assert res.exit_code == 2 and "runs[1] (b): rollout.group_size" in " ".join(
        res.output.split()
    ), res.output


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_command_line_names_the_run_that_stopped_and_exits_1(tmp_path, tiny_llama):
    from typer.testing import CliRunner

    from orbit.cli import app

    path = tmp_path / "r.yaml"
    runs = [
        {"name": "fine"},
        {"name": "breaks", "task": {"name": "tests/user_tasks.py:broken_scorer", "fail_after": 4}},
    ]
    path.write_text(yaml.safe_dump(recipe_dict(tiny_llama, tmp_path / "sweep", SWEEP, runs=runs)))
    res = CliRunner().invoke(app, ["sweep", str(path), "--steps", "3", "--quiet"])
    out = " ".join(res.output.split())
    assert res.exit_code == 1, res.output
    assert (
        "breaks stopped (the other runs go on)" in out
        and "1 of 2 runs stopped (the others finished): breaks:" in out
        and "verifier crashed" in out
    )
    assert len(run_metrics(tmp_path / "sweep" / "fine")) == 3
    # it failed before its first step: nothing of it is left but why
    broken = tmp_path / "sweep" / "breaks"
    assert "STOPPED" in (broken / "run.log").read_text() and not (broken / "metrics.jsonl").exists()
