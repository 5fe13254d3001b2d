"""tinker-cookbook's recipes, unmodified, against `orbit serve` (a few steps here; full length in
docs/tinker.md): on SmolLM2, math_rl on synthetic sums, chat_sl on the conversations file in the
cookbook's wheel, at once against one service (one base, one set of engines); on the tiny model,
math_rl on each engine and in async mode, preference.shorter, guess_number and prompt_distillation,
and the cookbook's KL penalty, distillation and DPO entry points (tests/tinker/)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from pathlib import Path

import pytest
from tinker_helpers import COOKBOOK_ENV, cookbook_script, metric_rows, sdk_python, serving

pytestmark = pytest.mark.slow


def _cookbook(recipe: str, args: dict[str, object], url: str) -> subprocess.Popen:
    """A recipe's command line against the service at `url`: its `base_url`, or for a command line
    without that field, the SDK's fallback, the environment's TINKER_BASE_URL."""
    base = {} if recipe in ENV_BASE_URL else {"base_url": url}
    words = [f"{k}={v}" for k, v in {**args, **base}.items()]
    return subprocess.Popen(
        [str(sdk_python()), "-m", f"tinker_cookbook.recipes.{recipe}.train", *words],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **COOKBOOK_ENV, "TINKER_BASE_URL": url},
    )


NO_BASE_URL = ("preference.shorter", "multiplayer_rl.guess_number")  # CLIs without the field
# rubric's CLI has the field, but its grader's client does not take it (rubric/env.py)
ENV_BASE_URL = (*NO_BASE_URL, "rubric")


def _math_rl(model: Path, log: Path, **overrides: object) -> dict[str, object]:
    """math_rl's command line for a few small steps on synthetic sums, its defaults (the loss among
    them) unless `overrides` says otherwise."""
    return {
        "model_name": model.resolve(),
        "renderer_name": "role_colon",
        "lora_rank": 4,
        "behavior_if_log_dir_exists": "delete",
        "env": "arithmetic",
        "group_size": 4,
        "groups_per_batch": 2,
        "max_tokens": 6,
        "max_steps": 2,
        "learning_rate": 3e-4,
        "eval_every": 0,
        "save_every": 0,
        "log_path": log,
        **overrides,
    }


def _conversations() -> Path:
    """The conversations file in the cookbook's wheel (chat_sl's and prompt_distillation's data)."""
    found = subprocess.run(
        [
            str(sdk_python()),
            "-c",
            "import tinker_cookbook, os; print(os.path.dirname(tinker_cookbook.__file__))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(found.stdout.strip()) / "example_data" / "conversations.jsonl"


def _finished(runs: dict[str, subprocess.Popen]) -> None:
    """Wait for every recipe `_cookbook` started (none outlives the test), then each must have
    succeeded (else the end of what it printed)."""
    printed = {name: run.communicate(timeout=540)[0] for name, run in runs.items()}
    for name, run in runs.items():
        assert run.returncode == 0, (name, printed[name][-4000:])


@pytest.mark.timeout(600)
def test_math_rl_and_chat_sl_run_at_once_against_one_service(smollm2, tmp_path):
    conversations = _conversations()
    common = {
        "model_name": smollm2.resolve(),
        "renderer_name": "role_colon",
        "lora_rank": 4,
        "behavior_if_log_dir_exists": "delete",
    }
    with serving(smollm2, tmp_path / "serve") as (url, service):
        rl = _cookbook(
            "math_rl",
            _math_rl(smollm2, tmp_path / "rl", loss_fn="importance_sampling"),
            url,
        )
        sl = _cookbook(
            "chat_sl",
            {
                **common,
                "dataset": conversations,
                "batch_size": 8,
                "max_length": 256,
                "max_steps": 2,
                "learning_rate": 1e-4,
                "save_every": 0,
                "eval_every": 0,
                "log_path": tmp_path / "sl",
            },
            url,
        )
        _finished({"rl": rl, "sl": sl})
        clients = len(service.store.clients())
    assert clients == 2  # one base, two adapters (released when each run closed its session)
    rl_rows = metric_rows(tmp_path / "rl")
    assert [r["step"] for r in rl_rows if "env/all/reward/total" in r] == [0, 1]
    # the sampler's logprobs and the trainer's agree (the cookbook measures it every step)
    assert all(
        abs(r["optim/kl_sample_train_v1"]) < 1e-3
        for r in rl_rows
        if "optim/kl_sample_train_v1" in r
    )
    sl_rows = metric_rows(tmp_path / "sl", "train_mean_nll")
    assert len(sl_rows) == 2 and all(r["train_mean_nll"] > 0 for r in sl_rows)
    for log in (tmp_path / "rl", tmp_path / "sl"):
        final = [json.loads(x) for x in (log / "checkpoints.jsonl").read_text().splitlines()][-1]
        assert final["state_path"].startswith("tinker://")


@pytest.mark.sglang
@pytest.mark.timeout(600)
@pytest.mark.parametrize("tinker_served", ["sglang", "sglang-server"], indirect=True)
def test_math_rl_steps_on_sglang(tinker_served, tmp_path):
    """The same recipe, unmodified and with its default loss (stable_reinforce: the sequences the
    SGLang engine sampled, recorded), on SGLang in-process and as a server (a LoRA on every
    projection and on the output projection, as the cookbook asks), on the tiny model: the SDK
    tests' services (tests/conftest.py), one start of each engine for both."""
    url, _, model = tinker_served
    rl = _cookbook(
        "math_rl",
        _math_rl(model, tmp_path / "rl"),
        url,
    )
    _finished({"rl": rl})
    rows = metric_rows(tmp_path / "rl", "optim/kl_sample_train_v1")
    assert len(rows) == 2
    print(f"\nkl_sample_train on SGLang: {[r['optim/kl_sample_train_v1'] for r in rows]}")
    assert all(abs(r["optim/kl_sample_train_v1"]) < 1e-2 for r in rows)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tinker_served", ["embedded"], indirect=True)
def test_math_rl_with_its_default_loss(tinker_served, tmp_path):
    """math_rl as it ships, its loss the default (`stable_reinforce`): the cookbook samples with
    record_stability_info and names each sampled token's sequence in its datums' provenance; the
    service trains on the sequences it recorded (the sampler's logprobs as the engine gave them)."""
    url, _, model = tinker_served
    rl = _cookbook(
        "math_rl",
        _math_rl(model, tmp_path / "rl"),
        url,
    )
    _finished({"rl": rl})
    assert "stable_reinforce" in (tmp_path / "rl" / "config.json").read_text()
    rows = metric_rows(tmp_path / "rl", "optim/kl_sample_train_v1")
    assert [r["step"] for r in rows] == [0, 1]
    assert all(abs(r["optim/kl_sample_train_v1"]) < 1e-3 for r in rows)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tinker_served", ["embedded"], indirect=True)
def test_math_rl_async_steps_off_policy(tinker_served, tmp_path):
    """The cookbook's async RL loop (`AsyncConfig`: sampling runs one step ahead of training), as it
    ships, with its default loss (stable_reinforce, made for off-policy data: the sequences a step
    trains on were recorded by the sampler a version before)."""
    url, _, model = tinker_served
    rl = _cookbook(
        "math_rl",
        _math_rl(model, tmp_path / "rl", max_steps_off_policy=1, max_steps=3),
        url,
    )
    _finished({"rl": rl})
    rows = metric_rows(tmp_path / "rl", "env/all/reward/total")
    assert [r["step"] for r in rows] == [0, 1, 2]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tinker_served", ["embedded"], indirect=True)
def test_the_rl_loop_with_a_kl_penalty_against_its_base(tinker_served, tmp_path):
    """The cookbook's RL loop with `kl_penalty_coef` and a `KLReferenceConfig` on the base model:
    its reference logprobs come from a sampling client's compute_logprobs (tests/tinker/
    cookbook_kl.py builds math_rl's Config and sets the two fields its command line lacks)."""
    url, _, model = tinker_served
    cookbook_script("cookbook_kl.py", url, model, tmp_path / "rl")
    rows = metric_rows(tmp_path / "rl", "env/all/reward/total")
    assert [r["step"] for r in rows] == [0, 1]
    kl = [k for r in rows for k in r if "kl" in k.lower()]
    print(f"\nKL metrics the cookbook logged: {sorted(set(kl))}")
    assert any("kl_policy_base" in k or "kl_penalty" in k for k in kl), kl


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tinker_served", ["embedded"], indirect=True)
def test_on_policy_distillation_from_a_teacher_this_service_trained(tinker_served, tmp_path):
    """The cookbook's on-policy distillation: a teacher that is a checkpoint a client of this
    service saved, whose logprobs of the student's samples (compute_logprobs) are the signal
    (tests/tinker/cookbook_distill.py)."""
    url, _, model = tinker_served
    printed = cookbook_script("cookbook_distill.py", url, model, tmp_path / "distill")
    assert "TEACHER tinker://" in printed
    rows = metric_rows(tmp_path / "distill", "teacher_kl")
    print(f"\nteacher_kl per step: {[r['teacher_kl'] for r in rows]}")
    assert len(rows) == 2 and all(r["teacher_kl"] == r["teacher_kl"] for r in rows)  # not NaN


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tinker_served", ["embedded"], indirect=True)
def test_rubric_with_a_grader_on_the_same_base(tinker_served, tmp_path):
    """`rubric.train` from its command line, its data made by the cookbook's own generate_dataset
    (synthetic sums, each graded against its rubric) and its grader the served base model: the
    grader's sampling client asks for 2048 tokens a grade (hence the tiny service's 4096)."""
    url, _, model = tinker_served
    make = (
        "from tinker_cookbook.recipes.rubric.generate_data import generate_dataset; "
        f"print(generate_dataset(8, 2, 0, write_dir={str(tmp_path)!r}))"
    )
    subprocess.run([str(sdk_python()), "-c", make], check=True, capture_output=True)
    args = {
        "model_name": model.resolve(),
        "renderer_name": "role_colon",
        "grader_llm_name": model.resolve(),
        "grader_renderer_name": "role_colon",
        "train_jsonl_path": tmp_path / "example_rubric_train.jsonl",
        "test_jsonl_path": tmp_path / "example_rubric_test.jsonl",
        "lora_rank": 4,
        "groups_per_batch": 2,
        "train_group_size": 2,
        "max_tokens": 6,
        "max_steps": 2,
        "eval_every": 0,
        "save_every": 0,
        "behavior_if_log_dir_exists": "delete",
        "log_path": tmp_path / "rubric",
    }
    run = _cookbook("rubric", args, url)
    _finished({"rubric": run})
    rows = metric_rows(tmp_path / "rubric", "env/all/reward/total")
    assert [r["step"] for r in rows] == [0, 1]
    assert all("env/all/rubric_score" in r for r in rows)  # every episode went to the grader


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tinker_served", ["embedded"], indirect=True)
def test_the_cookbooks_sweep_of_chat_sl_runs_two_at_once(tinker_served, tmp_path):
    """`chat_sl.sweep` from its command line: chat_sl at two learning rates, both runs at once
    (`max_parallel=2`), each a client of the one service; the sweep's own results table lists
    both (its budget of 64 examples at batch 32: two steps a run)."""
    url, service, model = tinker_served
    start = time.time()
    base = {
        "dataset": _conversations(),
        "model_name": model.resolve(),
        "renderer_name": "role_colon",
        "base_url": url,
        "batch_size": 32,
        "max_length": 256,
        "save_every": 0,
        "eval_every": 0,
        "behavior_if_log_dir_exists": "delete",
    }
    words = [f"base.{k}={v}" for k, v in base.items()] + [
        "recipe=sft",
        f"sweep_dir={tmp_path / 'sweep'}",
        "learning_rates=[1e-4,3e-4]",
        "lora_ranks=[4]",
        "training_budget_examples=64",
        "max_parallel=2",
    ]
    done = subprocess.run(
        [str(sdk_python()), "-m", "tinker_cookbook.recipes.chat_sl.sweep", *words],
        capture_output=True,
        text=True,
        timeout=540,
        env={**os.environ, **COOKBOOK_ENV},
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    runs = sorted(p.parent for p in (tmp_path / "sweep").rglob("metrics.jsonl"))
    assert len(runs) == 2, runs
    for run in runs:
        assert len(metric_rows(run, "train_mean_nll")) == 2, run
    most = max((p.clients for p in list(service.turns.packs) if p.at >= start), default=0)
    print(f"\nthe sweep's passes over the base: clients a pass at most {most}")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tinker_served", ["embedded"], indirect=True)
def test_forecasting_and_decisions_forecasting_on_a_local_csv(tinker_served, tmp_path):
    """`decisions.forecasting` from its command line on a local CSV in Prophet Arena's format
    (made here: markets closed before the split date train, later ones validate): it scores each
    yes/no decision through `target_prompt_logprobs` (its sample_decision) at the start and end,
    and trains a Brier loss through forward_backward_custom on [T, 2] soft targets; and
    `forecasting.train`, RL on the same markets (a sampled forecast scored against the outcome)."""
    url, _, model = tinker_served
    data = tmp_path / "markets.csv"
    _prophet_arena_csv(data)
    words = {
        "model_name": model.resolve(),
        "renderer_name": "role_colon",
        "data_path": data,
        "lora_rank": 4,
        "batch_size": 4,
        "max_steps": 2,
        "eval_every": 0,
        "behavior_if_log_dir_exists": "delete",
        "log_path": tmp_path / "log",
        "base_url": url,
    }
    done = subprocess.run(
        [str(sdk_python()), "-m", "tinker_cookbook.recipes.decisions.forecasting"]
        + [f"--{k}={v}" for k, v in words.items()],
        capture_output=True,
        text=True,
        timeout=540,
        env={**os.environ, **COOKBOOK_ENV},
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    rl = {
        "model_name": model.resolve(),
        "renderer_name": "role_colon",
        "data_path": data,
        "lora_rank": 4,
        "group_size": 2,
        "groups_per_batch": 2,
        "validation_group_size": 1,
        "max_tokens": 8,
        "max_steps": 2,
        "eval_every": 0,
        "save_every": 0,
        "behavior_if_log_dir_exists": "delete",
        "log_path": tmp_path / "rl",
    }
    run = _cookbook("forecasting", rl, url)
    _finished({"forecasting": run})
    steps = [r["step"] for r in metric_rows(tmp_path / "rl", "env/all/reward/total")]
    assert steps == [0, 1], steps
    rows = metric_rows(tmp_path / "log")
    scored = [r["test/brier_reward"] for r in rows if "test/brier_reward" in r]
    trained = [r["train/loss"] for r in rows if "train/loss" in r]
    print(f"\nvalidation Brier reward at the start and end {scored}, train loss {trained}")
    assert len(scored) == 2 and all(0 <= x <= 1 for x in scored), rows
    assert len(trained) == 2 and all(0 <= x <= 1 for x in trained), rows  # a Brier loss


def _prophet_arena_csv(path: Path) -> None:
    """Twelve one-market events in Prophet Arena's columns: eight that close before the recipe's
    default split date (2025-10-20), four that open after it."""
    import csv

    fields = ["submission_id", "event_ticker", "title", "snapshot_time", "close_time"]
    fields += ["market_outcome", "category", "markets", "sources"]
    with path.open("w", newline="") as f:
        out = csv.DictWriter(f, fieldnames=fields)
        out.writeheader()
        for i in range(12):
            month = 6 + i % 4 if i < 8 else 11
            market = f"Team {i} wins"
            out.writerow(
                {
                    "submission_id": f"s{i}",
                    "event_ticker": f"E{i}",
                    "title": f"Match {i}",
                    "snapshot_time": f"2025-{month:02d}-01T00:00:00Z",
                    "close_time": f"2025-{month:02d}-10T00:00:00Z",
                    "market_outcome": json.dumps({market: i % 2}),
                    "category": "Sports",
                    "markets": json.dumps([market]),
                    "sources": json.dumps([{"title": "News", "summary": f"Team {i} looks fit."}]),
                }
            )


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tinker_served", ["embedded"], indirect=True)
def test_chat_sl_with_its_nll_evaluator_on_held_out_conversations(tinker_served, tmp_path):
    """chat_sl's supervised loop on the cookbook's conversations file, 16 held out: the cookbook's
    NLL evaluator (compute_logprobs of each held-out conversation) runs at every step, and its NLL
    is the training loss's kind of number (tests/tinker/cookbook_sl_eval.py)."""
    url, _, model = tinker_served
    cookbook_script("cookbook_sl_eval.py", url, model, tmp_path / "sl")
    rows = metric_rows(tmp_path / "sl")
    tested = [r["test/nll"] for r in rows if "test/nll" in r]
    print(f"\nheld-out NLL per step: {tested}")
    assert len(tested) == 2 and all(0 < x < 20 for x in tested), rows
    assert any("train_mean_nll" in r for r in rows)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tinker_served", ["embedded"], indirect=True)
def test_dpo_on_preference_pairs_in_a_local_file(tinker_served, tmp_path):
    """The cookbook's DPO on labelled comparisons in a JSONL file: the reference model's logprobs
    are a sampling client's compute_logprobs, the DPO loss the SDK's client-side custom loss
    (tests/tinker/cookbook_dpo.py)."""
    url, _, model = tinker_served
    cookbook_script("cookbook_dpo.py", url, model, tmp_path / "dpo" / "log")
    rows = metric_rows(tmp_path / "dpo" / "log", "dpo_loss")
    print(f"\nDPO loss per step: {[r['dpo_loss'] for r in rows]}")
    assert len(rows) == 2
    # at step 0 the policy is the reference: the margin is 0 and the loss log 2, exactly when the
    # reference's compute_logprobs equal the policy's forward logprobs
    assert abs(rows[0]["dpo_loss"] - math.log(2)) < 1e-4 and abs(rows[0]["margin"]) < 1e-4
    assert rows[1]["dpo_loss"] < rows[0]["dpo_loss"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("tinker_served", ["embedded"], indirect=True)
def test_shorter_guess_number_and_prompt_distillation_run_as_they_ship(tinker_served, tmp_path):
    """Three recipes that bring their own data, unmodified, from their command lines, at once
    against one service: `preference.shorter`'s pairwise-preference RL (its preference model built
    in code; the cookbook's post-step KL through compute_logprobs), `multiplayer_rl.guess_number`'s
    multi-turn game (10 turns an episode, each a sample of the whole conversation so far: past the
    tiny model's 512 positions, hence the service's 2048, tests/conftest.py), and
    `prompt_distillation.train` (supervised, on the conversations file in the cookbook's wheel)."""
    url, _, model = tinker_served
    runs = {r: _cookbook(r, _game(model, tmp_path / r), url) for r in NO_BASE_URL}
    distill = {
        "model_name": model.resolve(),
        "renderer_name": "role_colon",
        "behavior_if_log_dir_exists": "delete",
        "file_path": _conversations(),
        "batch_size": 64,
        "num_epochs": 1,
        "max_length": 256,
        "lora_rank": 4,
        "save_every": 0,
        "eval_every": 0,
        "log_path": tmp_path / "distill",
    }
    runs["prompt_distillation"] = _cookbook("prompt_distillation", distill, url)
    _finished(runs)
    for recipe in NO_BASE_URL:
        steps = [r["step"] for r in metric_rows(tmp_path / recipe, "env/all/reward/total")]
        assert steps == [0, 1], (recipe, steps)
    steps = metric_rows(tmp_path / "distill", "train_mean_nll")
    assert len(steps) == 2 and all(r["train_mean_nll"] > 0 for r in steps), steps


def _game(model: Path, log: Path) -> dict[str, object]:
    """The command line of a recipe that builds its own data (shorter, guess_number), small."""
    return {
        "model_name": model.resolve(),
        "renderer_name": "role_colon",
        "behavior_if_log_dir_exists": "delete",
        "batch_size": 2,
        "group_size": 2,
        "max_tokens": 6,
        "max_steps": 2,
        "eval_every": 0,
        "log_path": log,
    }
