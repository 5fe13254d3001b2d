"""`task: verifiers`: a verifiers 0.4 taskset, run by a bridge in its own virtualenv (`make
verifiers`), every model call through Orbit's endpoint on the real embedded engine. Outside CI a
machine without that virtualenv skips these tests; in CI it fails (make test builds it)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from agent_helpers import with_chat_template
from run_helpers import checked, recipe_dict, run_metrics

from orbit.config import RecipeError
from orbit.run.lifecycle import train

ROOT = Path(__file__).resolve().parent.parent
VF_PYTHON = ROOT / ".venv-verifiers" / "bin" / "python"
TASKSETS = ROOT / "tests" / "vf_tasksets"


@pytest.fixture(scope="module")
def chat_model(tiny_llama) -> Path:
    return with_chat_template(tiny_llama, ROOT / ".cache" / "tiny" / "llama-s0-chat")


@pytest.fixture(scope="module")
def vf_python() -> Path:
    if not VF_PYTHON.exists():
        if os.environ.get("CI"):
            pytest.fail(
                "no .venv-verifiers: `make verifiers` builds it (CI must run the verifiers tests)"
            )
        pytest.skip("no .venv-verifiers (make verifiers)")
    return VF_PYTHON


def _recipe(model: Path, out: Path, taskset: str, python: Path, **patch) -> dict:
    task = {"name": "verifiers", "taskset": str(TASKSETS / taskset), "python": str(python)}
    return recipe_dict(
        model,
        out,
        {"task": task, "rollout": {"episode_timeout_s": 60, "max_new_tokens": 8}},
        **patch,
    )


def _bridges() -> list[int]:
    """Pids of this process's bridge children still running."""
    me = str(os.getpid())
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if fields[1] == me and b"verifiers_bridge.py" in cmdline:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_verifiers_taskset_trains_and_evaluates_through_the_endpoint(
    chat_model, vf_python, tmp_path
):
    """Each episode is one of the taskset's tasks, run by verifiers against the episode's URL; the
    reward is its rubric's; every generated token is trained, scored alike by engine and trainer;
    the bridge is gone after."""
    from orbit.measure.eval import resolve_target, run_eval

    out = tmp_path / "run"
    train(
        checked(_recipe(chat_model, out, "vf_questions.py", vf_python, trainer={"steps": 3})),
        live=False,
    )
    rows = run_metrics(out)
    assert len(rows) == 3 and all(r["trained_tokens"] > 0 and r["episodes_lost"] == 0 for r in rows)
    assert all(r["logprob_diff"] is not None and r["logprob_diff"] < 1e-3 for r in rows)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and all("What is" in s["prompt"] and 0.0 <= s["reward"] <= 1.0 for s in samples)
    assert _bridges() == []
    report = run_eval(resolve_target(out), n=4)
    assert report["results"]["base"]["n"] == 4 and report["results"]["trained"]["n"] == 4
    assert _bridges() == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_failing_rubric_loses_its_episode_not_the_run(chat_model, vf_python, tmp_path):
    out = tmp_path / "run"
    recipe = _recipe(chat_model, out, "vf_flaky.py", vf_python, trainer={"steps": 4})
    train(checked(recipe), live=False)
    rows = run_metrics(out)
    assert len(rows) == 4 and all(r["trained_tokens"] > 0 for r in rows)
    assert sum(r["episodes_lost"] for r in rows) >= 1
    assert "the rubric's own bug" in (out / "run.log").read_text()


def test_bad_verifiers_recipes_fail_before_any_compute(chat_model, vf_python, tmp_path):
    def error(**task) -> str:
        data = _recipe(chat_model, tmp_path / "r", "vf_questions.py", vf_python)
        data["task"].update(task)
        with pytest.raises(RecipeError) as err:
            checked(data)
        return str(err.value)

    assert "task.python: " in error(python=str(tmp_path / "no-python"))
    assert "task.taskset: no file" in error(taskset=str(tmp_path / "none.py"))
    assert "task.harnes: unknown key for task 'verifiers'" in error(harnes="x")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_taskset_verifiers_cannot_load_is_named_at_start(chat_model, vf_python, tmp_path):
    from orbit.run.lifecycle import train as run_train

    data = _recipe(chat_model, tmp_path / "r", "vf_questions.py", vf_python)
    data["task"]["taskset"] = "no_such_taskset_anywhere"
    with pytest.raises(
        RecipeError, match="task.taskset: verifiers could not load 'no_such_taskset_anywhere'"
    ):
        run_train(checked(data), live=False)
    assert _bridges() == []
    assert not (tmp_path / "r" / "metrics.jsonl").exists()
