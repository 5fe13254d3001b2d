"""A short `orbit bench`: all three outputs exist with the expected fields; bad arguments fail
clearly."""

from __future__ import annotations

import json
from statistics import median

import pytest
import yaml
from pool import run_pool_bench
from run_helpers import checked, recipe_dict, run_metrics, run_timeline
from straggler import Slowing

from orbit.config import RecipeError
from orbit.config.modes import MODE_NAMES, MODES
from orbit.measure.bench import HEADLINE, TIMED, engine_rate, floor_s, p90, run_bench, summarize
from orbit.measure.flops import flop_floor_s, matmul_params
from orbit.metrics.gantt import pack_lanes

pytestmark = pytest.mark.slow  # end-to-end: `make test-fast` leaves it out


def _recipe(model, out):
    return checked(recipe_dict(model, out, rollout={"max_new_tokens": 10}))


def test_short_bench_writes_summary_table_and_panels(tmp_path, tiny_llama):
    from rich.console import Console

    console = Console(record=True, width=200)
    # 3 measured steps: with 2, an overlapped mode's run-ahead could generate the last batch before
    # the measured window opened (engine busy 0 in it, seen once in CI); the 4th batch waits for a
    # flip inside the window
    result = run_bench(
        _recipe(tiny_llama, tmp_path / "x"), tmp_path / "bench", steps=3, warmup=1, console=console
    )
    summary = json.loads((tmp_path / "bench" / "summary.json").read_text())
    assert summary == json.loads(json.dumps(result.summary))
    assert list(summary["engines"]) == ["embedded"]
    section = summary["engines"]["embedded"]
    assert list(section["modes"]) == list(MODE_NAMES)
    for mode, s in section["modes"].items():
        assert s["steps"] == 3, mode
        rows = run_metrics(tmp_path / "bench" / "embedded" / mode)[1:]  # past the warm-up step
        for key in TIMED:  # each figure is the measured steps' own median and p90
            values = sorted(r[key] for r in rows if r.get(key) is not None)
            if not values:
                assert s[key] is None, (mode, key)
                continue
            assert s[key]["median"] == pytest.approx(median(values)) and s[key][
                "p90"
            ] == pytest.approx(values[-1])
        for key in (
            "staleness_mean",
            "staleness_max",
            "stale_dropped",
            "reward_mean",
            "waste_frac",
        ):
            assert key in s
        assert 0 < s["engine_busy_frac"] <= 1.05 and 0 < s["trainer_busy_frac"] < 1, mode
        # the floor arithmetic, recomputed from the run's own metrics lines
        for r in rows:
            assert r["trainer_idle_s"] == pytest.approx(r["train_wait_s"] + r["update_weights_s"])
        trainer = sum(r["train_s"] + r["update_weights_s"] for r in rows)
        busy = sum(r["engine_busy_s"] for r in rows)
        floor = (busy + trainer if MODES[mode].loop == "serial" else max(busy, trainer)) / len(rows)
        step = sum(r["step_s"] for r in rows) / len(rows)
        assert s["floor_s"] == pytest.approx(floor) and s["floor_ratio"] == pytest.approx(
            step / floor
        )
        # a floor is a bound: no mode's window is faster than its floor, on the summary's own
        # numbers
        assert s["floor_ratio"] >= 1.0, (mode, s["floor_ratio"])
        # the FLOP floor: the steps' useful FLOPs at the section's measured peak; a bound too
        work = (
            sum(4 * r["trained_tokens"] + 2 * r["tokens_generated"] for r in rows)
            * section["matmul_params"]
        )
        flop_floor = work / len(rows) / (section["peak_gflops"] * 1e9)
        assert flop_floor > 0 and s["flop_floor_s"] == pytest.approx(flop_floor)
        assert (
            s["flop_floor_ratio"] == pytest.approx(step / flop_floor) and s["flop_floor_ratio"] > 1
        )
    assert section["modes"]["sync"]["staleness_max"] == 0
    assert section["ratios"]["double-buffer"]["step_s"]["vs_sync"] > 0
    assert {t["target"] for t in section["targets"]} and all("met" in t for t in section["targets"])
    assert any("floor" in t["target"] for t in section["targets"])
    png = (tmp_path / "bench" / "embedded" / "panels.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    text = console.export_text()
    assert all(mode in text for mode in MODE_NAMES) and "vs sync" in text and "%" in text
    for _, label, _ in HEADLINE:
        assert label in text
    for label in (
        "useful tok/s",
        "waste",
        "floor",
        "FLOP floor (mean step/it)",
        "engine / trainer busy",
        "flip lag",
        "train wait",
    ):
        assert label in text


def test_floor_arithmetic():
    row = {
        "train_s": 0.5,
        "update_weights_s": 0.1,
        "trained_tokens": 900,
        "engine_busy_s": 1.6,
        "tokens_generated": 1200,
    }
    other = {**row, "train_s": 1.5, "engine_busy_s": 0.4}
    # busy / engines + train + push
    assert floor_s([row], True, 2) == pytest.approx(0.8 + 0.5 + 0.1)
    # the engine's busy time: generation-bound
    assert floor_s([row], False, 1) == pytest.approx(1.6)
    assert floor_s([row], False, 2) == pytest.approx(0.8)  # two engines: each busy 0.8 s
    # over the window, not step by step: the slower worker's total
    assert floor_s([row, other], False, 1) == pytest.approx(max(0.6 + 1.6, 1.6 + 0.4) / 2)
    # an engine's rate: tokens per second of busy time, per engine
    assert engine_rate([row, row], engines=2) == pytest.approx(2400 / 1.6 / 2)
    # the FLOP floor: 4 P a trained token, 2 P a generated one, at the peak
    assert flop_floor_s([row, other], params=1000, peak_gflops=2.0) == pytest.approx(
        (4 * 900 + 2 * 1200) * 1000 / 2e9
    )


def test_matmul_params_from_the_config_alone(tiny_llama):
    """P counts the decoder layers' weights and the output head without reading a weight, and the
    trainer's FLOP count takes the same P: its adapter's own weights (LoRA's A and B, inside the
    layers it wraps) are not in it."""
    from transformers import AutoModelForCausalLM

    from orbit.config import AdapterConfig, TrainerConfig
    from orbit.train.trainer import Trainer

    m = AutoModelForCausalLM.from_pretrained(tiny_llama)
    want = sum(p.numel() for p in m.model.layers.parameters()) + m.lm_head.weight.numel()
    assert matmul_params(tiny_llama) == want
    trainer = Trainer(tiny_llama, AdapterConfig(), TrainerConfig(), temperature=1.0, seed=0)
    try:
        lora = sum(p.numel() for p in trainer.params)
        assert lora > 0 and trainer.matmul_params == want
    finally:
        trainer.close()


@pytest.mark.alone  # a time bound: no other test beside it
def test_pool_bench_barrier_against_independent(tmp_path, tiny_llama):
    from rich.console import Console

    console = Console(record=True, width=200)
    recipe = _recipe(tiny_llama, tmp_path / "x")
    result = run_pool_bench(
        recipe,
        tmp_path / "pool",
        steps=2,
        warmup=1,
        replicas=2,
        slowing=Slowing(running=4, load_s=0.2),
        console=console,
    )
    summary = json.loads((tmp_path / "pool" / "summary.json").read_text())
    assert summary == json.loads(json.dumps(result.summary))
    assert set(summary["flips"]) == {"independent", "barrier"}
    assert summary["slow_engine"] == {"index": 1, "running": 4, "load_s": 0.2}
    for flip in ("barrier", "independent"):
        rows = run_metrics(tmp_path / "pool" / flip)
        assert all(r["engines_alive"] == 2 for r in rows)
        assert {
            e["engine"] for e in run_timeline(tmp_path / "pool" / flip) if e["kind"] == "request"
        } == {0, 1}
    # the barrier holds the trainer for the slow engine's load; independent flips do not
    assert summary["flips"]["barrier"]["update_weights_s"]["median"] >= 0.2
    assert summary["flips"]["independent"]["update_weights_s"]["median"] < 0.2
    assert set(summary["independent_vs_barrier"]) == {
        "step_s",
        "rollout_tok_per_dev_s",
        "trainer_idle_s",
        "flip_lag_s",
    }
    png = (tmp_path / "pool" / "panels.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert "independent / barrier" in console.export_text()


def test_summary_statistics():
    rows = [
        {
            "update_weights_s": v,
            "train_wait_s": v,
            "rollout_tok_per_dev_s": v,
            "useful_tok_per_dev_s": v,
            "step_s": v,
            "engine_paused_s": v,
            "staleness_mean": 1.0,
            "staleness_max": 2,
            "stale_dropped": 1,
            "reward_mean": 0.5,
            "logprob_diff": None,
            "tokens_generated": 100 * v,
            "waste_frac": 0.1 * (v < 3),
            "train_s": v / 2,
            "trainer_idle_s": v,
            "flip_lag_s": None,
            "engine_busy_s": v / 4,
        }
        for v in (1.0, 2.0, 3.0, 4.0, 10.0)
    ]
    s = summarize(rows, engines=1, floor=2.0)
    assert s["step_s"] == {"median": 3.0, "p90": 10.0}
    # a rate's mean is Σ tokens / Σ time (each step's rate weighted by its length), not the mean of
    # rates
    assert s["rollout_tok_per_dev_s"]["mean"] == pytest.approx(
        sum(v * v for v in (1, 2, 3, 4, 10)) / 20
    )
    assert s["flip_lag_s"] is None  # never measured: null, not zero
    # the mean step over the floor
    assert s["step_mean_s"] == 4.0 and s["floor_ratio"] == pytest.approx(2.0)
    assert s["trainer_busy_frac"] == pytest.approx(0.5) and s["engine_busy_frac"] == pytest.approx(
        0.25
    )
    assert s["stale_dropped"] == 5 and s["staleness_max"] == 2
    assert s["waste_frac"] == pytest.approx((10 + 20) / 2000)  # token-weighted over the steps
    assert (
        p90([5.0]) == 5.0 and p90([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0]) == 10.0
    )


def test_lanes_never_overlap():
    reqs = [{"t0": a, "t1": b} for a, b in [(0, 5), (1, 2), (2, 3), (4, 6), (5, 7)]]
    lanes = pack_lanes(reqs)
    for i, (r, lane) in enumerate(zip(reqs, lanes, strict=True)):
        for s, other in zip(reqs[:i], lanes[:i], strict=True):
            assert lane != other or s["t1"] <= r["t0"]


def _cli(*args: str):
    from typer.testing import CliRunner

    from orbit.cli import app

    return CliRunner().invoke(app, list(args))


def test_bad_bench_arguments(tmp_path, tiny_llama):
    with pytest.raises(RecipeError, match="--steps"):
        run_bench(_recipe(tiny_llama, tmp_path / "x"), tmp_path / "b", steps=0, warmup=1)
    with pytest.raises(RecipeError, match="--warmup"):
        run_bench(_recipe(tiny_llama, tmp_path / "x"), tmp_path / "b", steps=2, warmup=-1)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"model": str(tiny_llama), "rollout": {"group_size": 1}}))
    # the command line: one line each, exit 2 (in this process: the parsing is what is tested)
    res = _cli("bench", str(recipe), "--out", str(tmp_path / "b"))
    assert res.exit_code == 2 and "rollout.group_size" in res.output
    res = _cli("bench", str(recipe), "--engine", "tgi")
    assert res.exit_code == 2 and "tgi" in res.output
    # a good recipe: the flags are what is bad
    recipe.write_text(yaml.safe_dump({"model": str(tiny_llama)}))
    res = _cli("bench", str(recipe), "--engines", "embedded,tgi")
    assert res.exit_code == 2 and "--engines" in res.output and "tgi" in res.output
    # the pool bench (bench/pool.py)
    with pytest.raises(RecipeError, match="--flip: 'x' is not a flip"):
        run_pool_bench(
            checked(recipe_dict(tiny_llama, tmp_path / "x")), tmp_path / "b", 2, 1, flips=("x",)
        )
    assert not (tmp_path / "b").exists()


def test_bench_stops_cleanly_on_task_errors_and_ctrl_c(tmp_path, tiny_llama, monkeypatch):
    """A task that fails mid-bench and Ctrl-C both end the bench with one clear line and an exit
    code."""
    from typer.testing import CliRunner

    import orbit.run.engines
    from orbit.cli import app

    recipe = tmp_path / "r.yaml"
    data = {
        "model": str(tiny_llama),
        "adapter": {"r": 4, "alpha": 8},
        "rollout": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 6},
        "task": {"name": "tests/user_tasks.py:broken_scorer", "fail_after": 6},
    }
    recipe.write_text(yaml.safe_dump(data))
    res = CliRunner().invoke(
        app, ["bench", str(recipe), "--steps", "2", "--warmup", "0", "--out", str(tmp_path / "b")]
    )
    flat = " ".join(res.output.split())
    assert res.exit_code == 1 and "the task failed" in flat and "verifier crashed" in flat, (
        res.output
    )
    assert "Traceback" not in res.output

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(orbit.run.engines, "start_pool", interrupted)
    data["task"] = {"name": "pattern"}
    recipe.write_text(yaml.safe_dump(data))
    res = CliRunner().invoke(
        app, ["bench", str(recipe), "--steps", "2", "--warmup", "0", "--out", str(tmp_path / "c")]
    )
    assert res.exit_code == 130 and "nothing was trained" in " ".join(res.output.split()), (
        res.output
    )


def test_vs_trl_times_each_run_to_its_first_checkpoint_at_the_accuracy():
    """bench/vs_trl.py's time to accuracy: the first checkpoint at or above `--reach`, from launch;
    a run that never reaches it says so, and the ratio is over the seeds where both did."""
    from vs_trl import median_ratio, time_to

    run = {"checkpoints": [{"t": 60.0, "accuracy": 0.3}, {"t": 120.0, "accuracy": 0.55}]}
    assert time_to(run, 0.5) == 120.0 and time_to(run, 0.3) == 60.0 and time_to(run, 0.6) is None
    runs = {
        s: {"orbit": {"figures": {"k": o}}, "trl": {"figures": {"k": t}}}
        for s, (o, t) in enumerate([(100.0, 400.0), (200.0, None), (100.0, 300.0)])
    }
    assert median_ratio(runs, "k") == "3.50×"
    assert median_ratio({0: runs[1]}, "k") == "-"


def test_cores_table_gives_medians_over_seeds_and_each_seeds_own_ratio():
    """bench/investigations/cores.py over several seeds: a figure's median [range], and the on/off
    ratio is the median of each seed's own ratio (not the ratio of the medians)."""
    from cores import table

    def run(step: float, train: float) -> dict:
        return {
            "step_s": step,
            "train_s": train,
            "train_ms_per_token": train,
            "engine_tok_per_busy_s": 100.0,
            "borrowed": 0.5,
            "useful_gflops": 50.0,
        }

    steps = {"off": (10.0, 12.0, 20.0), "on": (9.0, 12.0, 10.0)}
    runs = {
        f"embedded/{setting}/{seed}": run(steps[setting][seed], 8.0)
        for setting in steps
        for seed in range(3)
    }
    text = table(
        {"peak_gflops": {1: 90.0, 2: 100.0}, "runs": runs}, ["embedded"], ["off", "on"], [0, 1, 2]
    )
    assert "| embedded | off | 12.00 [10.00–20.00] | 8.00 [8.00–8.00] | 8.0 [8.0–8.0] |" in text
    assert "| 0.50 [0.50–0.50] |" in text  # useful over the 2-thread peak
    # ratios 0.9, 1.0, 0.5: the median is 0.9 (the medians' ratio would be 10/12)
    assert "| embedded | 0.900× [0.500×–1.000×] | 1.000× [1.000×–1.000×] |" in text


def test_vs_trl_figures_read_the_late_steps_and_the_step_10_checkpoint():
    """bench/vs_trl.py: engine tokens per trained token and the trainer's wait share are over steps
    31 on; held out at step 10 is that checkpoint's; time to accuracy is the first checkpoint at
    the threshold."""
    from vs_trl import figures

    steps = [
        {
            "step": i,
            "step_s": 10.0,
            "reward": 0.5,
            "generated": 300 if i < 30 else 900,
            "trained": 300,
            "wait_s": 1.0 if i < 30 else 6.0,
        }
        for i in range(60)
    ]
    checkpoints = [
        {"step": s, "t": 10.0 * s, "accuracy": a}
        for s, a in ((5, 0.2), (10, 0.35), (15, 0.55), (20, 0.5))
    ]
    result = {
        "steps": steps,
        "checkpoints": checkpoints,
        "wall_s": 600.0,
        "peak_gb": 1.0,
        "base_accuracy": 0.17,
    }
    f = figures(result, reach=0.5)
    assert f["generated_per_trained_late"] == 3.0 and f["wait_share_late"] == 0.6
    assert f["held_out_10"] == 0.35 and f["time_to_reach_s"] == 150.0
    # TRL's metrics have neither trained tokens nor waits
    for s in steps:
        del s["trained"], s["wait_s"]
    f = figures(result, reach=0.5)
    assert f["generated_per_trained_late"] is None and f["wait_share_late"] is None


def test_learning_table_gives_each_variant_its_median_and_first_crossing():
    from learning import reached, table

    class Args:
        recipe, seeds, n, reach = "r.yaml", "0,1,2", 200, 0.5

    curves = {
        "default": [
            {0: 0.17, 5: 0.2, 10: 0.4},
            {0: 0.17, 5: 0.3, 10: 0.5},
            {0: 0.17, 5: 0.6, 10: 0.7},
        ],
    }
    text = table(Args, curves)
    assert "| default | 30.0 [20.0–60.0] | 50.0 [40.0–70.0] | steps -, 10, 5 |" in text
    assert reached({0: 0.17, 5: 0.49, 10: 0.5}, 0.5) == 10
