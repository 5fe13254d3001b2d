"""End to end on the embedded engine: every mode trains, writes its metrics, and behaves as
designed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from admission import run_ahead
from run_helpers import (
    check_no_request_ran_on_a_slot_being_written,
    checked,
    recipe_dict,
    run_metrics,
    run_timeline,
)

from orbit.config.modes import MODE_NAMES
from orbit.metrics.steps import METRIC_FIELDS
from orbit.run.lifecycle import train

pytestmark = pytest.mark.slow  # end-to-end: `make test-fast` leaves it out

LOGPROB_DIFF_MAX = 1e-3  # fp32 engine vs fp32 trainer on the same tokens


def _recipe(model: Path, out: Path, **patch) -> dict:
    return recipe_dict(model, out, {"trainer": {"save_every": 2}}, **patch)


@pytest.mark.parametrize("mode", MODE_NAMES)
def test_each_mode_runs_and_writes_every_metric(tmp_path, tiny_llama, mode):
    recipe = checked(_recipe(tiny_llama, tmp_path / mode, mode=mode, max_staleness=2))
    result = train(recipe, live=False)
    assert result.steps_done == 3
    rows = run_metrics(tmp_path / mode)
    assert [r["step"] for r in rows] == [0, 1, 2] and [r["version"] for r in rows] == [1, 2, 3]
    for row in rows:
        missing = [f for f in METRIC_FIELDS if f not in row]
        assert not missing, f"{mode}: missing {missing}"
        assert row["mode"] == mode and row["step_s"] > 0 and row["rollout_tok_per_dev_s"] >= 0
        assert row["full_push"] == (mode in ("sync", "async-full"))
        if mode in ("sync", "sync-adapter"):
            assert row["staleness_max"] == 0 and row["staleness_mean"] == 0
        else:
            assert 0 <= row["staleness_max"] <= 2
    assert sum(r["tokens_generated"] for r in rows) > 0
    assert rows[0]["logprob_diff"] is not None and rows[0]["logprob_diff"] < LOGPROB_DIFF_MAX
    for row in rows:
        assert row["ratio_max"] >= row["ratio_mean"] > 0 and 0 <= row["clip_frac"] <= 1
        assert 0 <= row["waste_frac"] and row["useful_tok_per_dev_s"] > 0
    kinds = {(e["actor"], e["kind"]) for e in run_timeline(tmp_path / mode)}
    assert {
        ("trainer", "wait"),
        ("trainer", "train"),
        ("trainer", "push"),
        ("engine", "request"),
    } <= kinds
    assert (tmp_path / mode / "adapter" / "adapter_model.safetensors").exists()


@pytest.mark.timeout(300)
def test_dapo_keeps_every_batch_full_of_signal_and_nothing_stale(tmp_path, warm_arith):
    """algorithm.preset: dapo on the warm-started arithmetic model, double-buffer: groups of 2 whose
    rewards are often equal (both right or both wrong) are dropped and replaced; every step still
    trains a full batch of groups that carry signal, no group goes stale, and the step's figures say
    what was filtered."""
    patch = {
        "rollout": {"group_size": 2, "prompts_per_step": 4, "max_new_tokens": 8},
        "trainer": {"steps": 8, "lr": 0.002},
        "task": {"name": "arith", "max_digits": 2, "ops": "+-"},
        "algorithm": {"preset": "dapo"},
        "mode": "double-buffer",
        "max_staleness": 1,
    }
    train(checked(_recipe(warm_arith, tmp_path / "run", **patch)), live=False)
    rows = run_metrics(tmp_path / "run")
    assert len(rows) == 8 and sum(r["groups_filtered"] for r in rows) > 0
    for r in rows:
        assert r["stale_dropped"] == 0 and r["staleness_max"] <= 1 and r["waste_frac"] == 0
        # the batch's 4 groups all carried signal: only the filtered ones were silent
        f = r["groups_filtered"]
        assert r["zero_variance_frac"] == pytest.approx(f / (4 + f))
        assert r["entropy"] > 0 and r["lr"] == 0.002 and r["optimizer_steps"] == 1
    recipe = yaml.safe_load((tmp_path / "run" / "recipe.yaml").read_text())
    assert (
        recipe["algorithm"]["clip_eps_high"] == 0.28
        and recipe["algorithm"]["dynamic_sampling"] is True
    )


@pytest.mark.timeout(300)
def test_staged_sampling_generates_a_group_only_for_prompts_whose_probe_differs(
    tmp_path, warm_arith
):
    """algorithm.screen: 2 of groups of 4 on the embedded engine, probes from the start: a prompt
    whose probe's two answers are both right is dropped with no group; every trained group is a
    whole group of 4 fresh samples, within the staleness bound."""
    patch = {
        "rollout": {"group_size": 4, "prompts_per_step": 4, "max_new_tokens": 8},
        "trainer": {"steps": 6, "lr": 0.002},
        "task": {"name": "arith", "max_digits": 2, "ops": "+-"},
        "algorithm": {"preset": "dapo", "screen": 2, "screen_from": 0},
        "mode": "double-buffer",
        "max_staleness": 1,
    }
    train(checked(_recipe(warm_arith, tmp_path / "run", **patch)), live=False)
    rows = run_metrics(tmp_path / "run")
    screened = sum(r["groups_screened"] for r in rows)
    assert len(rows) == 6 and screened > 0
    assert all(r["groups_screened"] <= r["groups_filtered"] for r in rows)
    assert all(r["staleness_max"] <= 1 for r in rows)
    requests: dict[int, int] = {}
    probes: dict[int, int] = {}
    for line in (tmp_path / "run" / "timeline.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e["kind"] == "request" and e["finish"] != "abort":
            counts = probes if e.get("probe") else requests
            counts[e["group"]] = counts.get(e["group"], 0) + 1
    logged = (tmp_path / "run" / "samples.jsonl").read_text().splitlines()
    trained = {json.loads(line)["group"] for line in logged}
    assert trained and all(requests[g] == 4 and probes[g] == 2 for g in trained)
    # a prompt screened out has its probe and no group; the last ones may be in flight
    assert sum(n == 2 and g not in requests for g, n in probes.items()) >= screened
    assert all(n <= 4 for n in requests.values()) and all(n <= 2 for n in probes.values())


def test_truncated_sampling_end_to_end_with_task_figures(tmp_path, tiny_llama):
    """top_p/top_k: engine and trainer score the same truncated distribution, so logprob_diff stays
    at rounding (it would be ~1 with one side untruncated); a task that knows correctness gets its
    figures."""
    recipe = checked(
        _recipe(
            tiny_llama,
            tmp_path / "run",
            mode="double-buffer",
            max_staleness=1,
            rollout={"top_p": 0.8, "top_k": 5, "temperature": 0.8},
            trainer={"steps": 4},
            task={"name": "tests/user_tasks.py:count_word"},
            adapter={"dropout": 0.1},
        )
    )
    train(recipe, live=False)
    rows = run_metrics(tmp_path / "run")
    for row in rows:
        assert row["logprob_diff"] is not None and row["logprob_diff"] < LOGPROB_DIFF_MAX
        assert 0 <= row["correct_rate"] <= 1 and row["format_rate"] == 1.0
        assert sum(row["failure_modes"].values()) == 8 and set(row["failure_modes"]) <= {
            "success",
            "wrong_answer",
        }


@pytest.mark.timeout(180)  # a drained pipeline would hang: the timeout fails the test
@pytest.mark.parametrize("mode, k", [("async-adapter", 0), ("double-buffer", 0), ("async-full", 1)])
def test_drop_and_replenish_never_hangs(tmp_path, tiny_llama, mode, k):
    recipe = checked(
        _recipe(
            tiny_llama,
            tmp_path / "run",
            mode=mode,
            max_staleness=k,
            # many requests in flight per batch, and the former run-ahead admission, which starts
            # groups that go stale: the drop-and-replenish safety net must carry the run
            engine={"max_inflight": 24, "max_running": 24},
            rollout={"max_new_tokens": 24},
            trainer={"steps": 6},
        )
    )
    with run_ahead():
        train(recipe, live=False)
    rows = run_metrics(tmp_path / "run")
    assert len(rows) == 6
    assert all(r["staleness_max"] <= k for r in rows)
    if k == 0:
        assert sum(r["stale_dropped"] for r in rows) > 0, "the drop path was never exercised"


def test_double_buffer_never_runs_a_request_on_a_slot_being_written(tmp_path, tiny_llama):
    recipe = checked(
        _recipe(
            tiny_llama,
            tmp_path / "run",
            mode="double-buffer",
            max_staleness=None,
            # run-ahead admission keeps requests in flight two versions back, so loads meet them
            engine={"max_inflight": 24, "max_running": 24},
            rollout={"max_new_tokens": 160},
            trainer={"steps": 6},
        )
    )
    with run_ahead():
        train(recipe, live=False)
    events = run_timeline(tmp_path / "run")
    assert any(e["kind"] == "request" for e in events)
    assert check_no_request_ran_on_a_slot_being_written(events) >= 6
    # long requests outlive a train step: a load met requests on its slot and aborted them
    assert any(e["kind"] == "request" and e["finish"] == "abort" for e in events), (
        "the abort path was never exercised"
    )


@pytest.mark.parametrize(
    "adapter",
    [
        {
            "type": "lora",
            "r": 8,
            "alpha": 16,
            "target_modules": ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
        },
        {
            "type": "oft",
            "oft_block_size": 8,
            "target_modules": ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
        },
    ],
)
def test_reward_rises_in_double_buffer(tmp_path, tiny_llama, adapter):
    lr = 0.02 if adapter["type"] == "lora" else 0.01
    recipe = checked(
        _recipe(
            tiny_llama,
            tmp_path / "run",
            mode="double-buffer",
            adapter=adapter,
            max_staleness=1,
            engine={"max_inflight": 32, "max_running": 32},
            rollout={"group_size": 8, "prompts_per_step": 4, "max_new_tokens": 16},
            trainer={"steps": 24, "lr": lr, "save_every": 100},
        )
    )
    train(recipe, live=False)
    rewards = [r["reward_mean"] for r in run_metrics(tmp_path / "run")]
    q = len(rewards) // 4
    first, last = sum(rewards[:q]) / q, sum(rewards[-q:]) / q
    print(f"\n{adapter['type']}: reward, first quarter {first:.3f}, last quarter {last:.3f}")
    assert last > first + 0.15, (
        f"reward did not rise: first quarter {first:.3f}, last quarter {last:.3f}"
    )
    diffs = [r["logprob_diff"] for r in run_metrics(tmp_path / "run")]
    assert None not in diffs, "logprob_diff must be measured every step"
    assert max(diffs) < LOGPROB_DIFF_MAX


def test_ctrl_c_saves_a_loadable_adapter_and_resume_continues(tmp_path, tiny_llama):
    run_dir = tmp_path / "run"
    recipe_path = tmp_path / "r.yaml"
    recipe_path.write_text(
        yaml.safe_dump(
            _recipe(
                tiny_llama,
                run_dir,
                mode="double-buffer",
                trainer={"steps": 400, "save_every": 1000},
            )
        )
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "orbit.cli", "train", str(recipe_path), "--quiet"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    deadline = time.time() + 120
    while time.time() < deadline:
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert "interrupted at step" in err and "--resume" in err
    done = len(run_metrics(run_dir))
    state = json.loads((run_dir / "adapter" / "trainer_state.json").read_text())
    assert state["version"] >= done >= 2

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama), run_dir / "adapter")

    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "orbit.cli",
            "train",
            str(recipe_path),
            "--resume",
            str(run_dir),
            "--steps",
            str(state["version"] + 2),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    rows = run_metrics(run_dir)
    assert [r["step"] for r in rows[-2:]] == [state["version"], state["version"] + 1]
    assert (
        json.loads((run_dir / "adapter" / "trainer_state.json").read_text())["version"]
        == state["version"] + 2
    )


def test_existing_run_is_not_overwritten(tmp_path, tiny_llama):
    from orbit.config import RecipeError

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(RecipeError, match="already holds a run"):
        train(checked(_recipe(tiny_llama, run_dir)), live=False)
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 0}\n'
