"""`orbit eval`, and the main claim: RL on the warm-started tiny model raises held-out accuracy.

The claim, as a user runs it (recipes/tiny-arith.yaml):

    orbit model tiny .cache/tiny/arith --task arith
    orbit train recipes/tiny-arith.yaml --mode double-buffer --out runs/tiny-arith
    orbit eval runs/tiny-arith --n 200
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from orbit.cli import app
from orbit.config import RecipeError, load_recipe
from orbit.measure.eval import resolve_target, run_eval
from orbit.run.lifecycle import train
from orbit.run.preflight import preflight

pytestmark = pytest.mark.slow  # end-to-end: `make test-fast` leaves it out

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "tiny-arith.yaml"
EVAL_N = 200
MIN_GAIN = 0.10  # measured: +17 to +30 points over seeds and runs; the test asks for 10
# The default algorithm's recorded run (bench/default_run.py): this recipe names no preset, so it is
# the default-run test. Its gain over the warm start may fall at most this far below the recorded
# worst seed's (3 seeds gained 26-30 points; double-buffer timing alone moves a seed 2-3 points).
# Gains, not accuracies: the warm start itself differs between machines (30.5% held out where the
# seeds were recorded, 27-28% on others: orbit/host/floats.py), and so does what RL makes of it.
BASELINE = Path(__file__).resolve().parent / "data" / "default_run.json"
BELOW_BASELINE = 0.10


@pytest.fixture(scope="module")
def arith_run(tmp_path_factory, warm_arith) -> Path:
    """recipes/tiny-arith.yaml, as is but for the model and run paths: double-buffer, 80 steps."""
    run_dir = tmp_path_factory.mktemp("arith") / "run"
    recipe = load_recipe(
        RECIPE, {"model": str(warm_arith), "out": str(run_dir), "mode": "double-buffer"}
    )
    assert recipe.mode == "double-buffer" and recipe.task.name == "arith"
    recorded = json.loads(BASELINE.read_text())["preset"]
    assert recipe.algorithm.preset == recorded, (
        f"the default is now {recipe.algorithm.preset}, the baseline was recorded with {recorded}: "
        "run bench/default_run.py"
    )
    result = train(preflight(recipe), live=False)
    assert result.steps_done == recipe.trainer.steps
    return run_dir


def _recorded_default() -> list[dict]:
    return list(json.loads(BASELINE.read_text())["runs"]["default"].values())


@pytest.mark.timeout(300)
def test_rl_raises_held_out_accuracy_over_the_warm_start(arith_run):
    res = CliRunner().invoke(app, ["eval", str(arith_run), "--n", str(EVAL_N)])
    assert res.exit_code == 0, res.output
    report = json.loads((arith_run / "eval.json").read_text())
    base, trained = report["results"]["base"], report["results"]["trained"]
    print(
        f"held-out accuracy: warm start {base['accuracy']:.1%} -> trained "
        f"{trained['accuracy']:.1%} (format {base['format_rate']:.1%} -> "
        f"{trained['format_rate']:.1%})"
    )
    assert 0.2 <= base["accuracy"] <= 0.6  # partial competence: RL has room
    gain = trained["accuracy"] - base["accuracy"]
    recorded = [r["trained"] - r["base"] for r in _recorded_default()]
    assert gain >= max(MIN_GAIN, min(recorded) - BELOW_BASELINE), (
        f"the default gained {gain:+.1%} over the warm start; its recorded seeds gained "
        f"{', '.join(f'{g:+.1%}' for g in sorted(recorded))}"
    )
    assert report["delta"]["accuracy"] == pytest.approx(trained["accuracy"] - base["accuracy"])
    # the table names both models and the failure modes
    for word in ("accuracy", "format rate", "base", "trained", "wrong_format", "wrong_answer"):
        assert word in res.output


def test_eval_report_fields(arith_run):
    report = (
        json.loads((arith_run / "eval.json").read_text())
        if (arith_run / "eval.json").exists()
        else None
    )
    if report is None:
        report = run_eval(resolve_target(arith_run), n=EVAL_N)
    assert report["kind"] == "run" and report["split"] == "eval" and report["decoding"] == "greedy"
    assert report["n"] == EVAL_N and report["task"]["name"] == "arith"
    for which in ("base", "trained"):
        r = report["results"][which]
        assert set(r) >= {
            "n",
            "accuracy",
            "format_rate",
            "reward_mean",
            "avg_turns",
            "avg_tool_calls",
            "failure_modes",
        }
        assert sum(r["failure_modes"].values()) == EVAL_N
        assert set(r["failure_modes"]) >= {"success", "wrong_format", "tool_spam", "wrong_answer"}
        assert r["failure_modes"]["success"] == round(r["accuracy"] * EVAL_N)
        assert r["avg_turns"] == 1.0 and r["avg_tool_calls"] == 0.0  # arith: single turn, no tools
    samples = [
        json.loads(line) for line in (arith_run / "eval_samples.jsonl").read_text().splitlines()
    ]
    assert len(samples) == 2 * EVAL_N and {s["model"] for s in samples} == {"base", "trained"}
    assert all(s["id"].startswith("arith-eval-") for s in samples)  # held-out prompts only


def test_eval_adapter_dir_writes_next_to_the_adapter(arith_run, tmp_path):
    adapter = arith_run / "adapter"
    report = run_eval(resolve_target(adapter), n=20)
    assert report["kind"] == "adapter" and list(report["results"]) == ["trained"]
    assert (
        report["adapter_version"]
        == json.loads((adapter / "trainer_state.json").read_text())["version"]
    )
    assert json.loads((adapter / "eval.json").read_text())["results"]["trained"]["n"] == 20


@pytest.mark.timeout(240)
def test_eval_multi_turn_counts_turns_and_tool_calls(warm_zorplex, tmp_path):
    model = tmp_path / "zorplex"
    shutil.copytree(warm_zorplex, model)  # eval.json goes into the model directory: not the cache
    report = run_eval(resolve_target(model, task="zorplex"), n=40)
    r = report["results"]["base"]
    assert report["kind"] == "model" and r["n"] == 40
    assert r["avg_tool_calls"] > 1.0 and r["avg_turns"] > 2.0  # the warm start calls the tool
    assert r["avg_turns"] == pytest.approx(r["avg_tool_calls"] + 1, abs=0.2)
    records = [json.loads(line) for line in (model / "eval_samples.jsonl").read_text().splitlines()]
    with_tools = [x for x in records if 0 in x["loss_mask"]]
    assert with_tools and all("LOOKUP(" in x["output"] for x in with_tools)


def test_eval_errors(tmp_path, tiny_llama):
    with pytest.raises(RecipeError, match="not a run directory"):
        resolve_target(tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "recipe.yaml").write_text(yaml.safe_dump({"model": str(tiny_llama)}))
    with pytest.raises(RecipeError, match="has no adapter yet"):
        resolve_target(tmp_path / "run")
    with pytest.raises(RecipeError, match="--task: required"):
        resolve_target(tiny_llama)
    with pytest.raises(RecipeError, match="task.name: unknown task 'nope'"):
        resolve_target(tiny_llama, task="nope")
    res = CliRunner().invoke(app, ["eval", str(tmp_path)])
    assert res.exit_code == 2 and "not a run directory" in res.output


def test_eval_tells_a_missing_split_from_a_task_bug(tiny_llama):
    """A task without an eval split is a usage error (exit 2); a TypeError inside the task's own
    eval prompts is the task failing (exit 1), not 'no held-out split'."""
    res = CliRunner().invoke(
        app, ["eval", str(tiny_llama), "--task", "tests/user_tasks.py:no_split", "--n", "2"]
    )
    assert res.exit_code == 2 and "has no held-out split" in res.output, res.output
    res = CliRunner().invoke(
        app, ["eval", str(tiny_llama), "--task", "tests/user_tasks.py:eval_split_bug", "--n", "2"]
    )
    flat = " ".join(res.output.split())
    assert res.exit_code == 1 and "the task failed" in flat and "TypeError" in flat, res.output
    assert "no held-out split" not in flat


def test_eval_jsonl_dataset_stops_at_its_held_out_rows(tmp_path, tiny_task_tokens):
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "answer": i + 1}) + "\n" for i in range(30))
    )
    model = tmp_path / "model"
    shutil.copytree(tiny_task_tokens, model)
    report = run_eval(resolve_target(model, task=str(data), max_new_tokens=4), n=50)
    assert report["n"] == 3 and report["task"] == {"name": "jsonl", "path": str(data)}
    records = [json.loads(line) for line in (model / "eval_samples.jsonl").read_text().splitlines()]
    assert sorted(r["prompt"] for r in records) == ["19+1=", "29+1=", "9+1="]


def test_eval_sizes_the_engine_to_the_runs_context(tmp_path, tiny_llama):
    """A run's engine.max_context bounds the eval's engine too (its KV pool: 64 rows of SmolLM2 at
    the engine's own 4096 took 13 GB for the agent recipe's eval, at the run's 512 under 2)."""
    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    (run / "adapter" / "adapter_config.json").write_text("{}")
    recipe = {"model": str(tiny_llama), "engine": {"max_context": 256}, "task": {"name": "arith"}}
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert resolve_target(run).max_context == 256
    del recipe["engine"]
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert resolve_target(run).max_context is None


def test_eval_reuses_the_base_result_until_model_or_prompts_change(
    warm_arith, tmp_path, monkeypatch
):
    """The base's held-out result is stored and reused (orbit/measure/eval_cache.py); a different
    model file, other prompts or `--fresh-base` evaluate it again."""
    monkeypatch.setenv("ORBIT_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "arith"
    shutil.copytree(warm_arith, model)
    first = run_eval(resolve_target(model, task="arith"), n=20)
    assert first["base_from"] is None
    stored = list((tmp_path / "cache" / "eval").glob("*.json"))
    assert len(stored) == 1
    again = run_eval(resolve_target(model, task="arith"), n=20)
    assert again["base_from"] == str(stored[0])
    assert again["results"]["base"] == first["results"]["base"]
    samples = (model / "eval_samples.jsonl").read_text().splitlines()
    assert len(samples) == 20 and all(json.loads(s)["model"] == "base" for s in samples)
    assert run_eval(resolve_target(model, task="arith"), n=20, fresh_base=True)["base_from"] is None
    assert run_eval(resolve_target(model, task="arith"), n=10)["base_from"] is None  # other prompts
    config = model / "config.json"
    config.write_text(config.read_text())  # the same bytes, a new modification time
    assert run_eval(resolve_target(model, task="arith"), n=20)["base_from"] is None
    assert len(list((tmp_path / "cache" / "eval").glob("*.json"))) == 3
