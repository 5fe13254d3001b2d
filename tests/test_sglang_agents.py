"""Agent and reasoning-gym tasks on SGLang, in-process and as a server: one sweep each, its two runs
an agent written against the `openai` client (through Orbit's endpoint, in front of SGLang) and a
reasoning-gym dataset, a few steps each, the engine's and the trainer's logprobs of the same tokens
agreeing every step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from agent_helpers import with_chat_template
from run_helpers import run_metrics

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
LOGPROB_DIFF_MAX = 1e-3
STEPS = 3


@pytest.mark.timeout(420)
@pytest.mark.parametrize("backend", ["sglang", "sglang-server"])
def test_an_agent_and_a_reasoning_gym_task_train_on_sglang(tmp_path, tiny_llama, backend):
    model = with_chat_template(tiny_llama, ROOT / ".cache" / "tiny" / "llama-s0-chat")
    recipe = {
        "model": str(model),
        "out": str(tmp_path / "sweep"),
        "mode": "double-buffer",
        "seed": 1,
        "adapter": {"type": "lora", "r": 8, "alpha": 16},
        "engine": {"backend": backend, "max_inflight": 16, "max_running": 32},
        "rollout": {
            "group_size": 4,
            "prompts_per_step": 2,
            "max_new_tokens": 8,
            "episode_timeout_s": 120,
        },
        "trainer": {"lr": 0.01, "steps": STEPS, "save_every": STEPS},
        # the random tiny model gets every answer wrong: the default's dynamic sampling would stop
        # the run for want of signal (as it should); this test is of the tasks on SGLang
        "algorithm": {"preset": "orbit_v1"},
        "runs": [
            {
                "name": "agent",
                "task": {
                    "name": "agent",
                    "entry": f"{ROOT}/tests/agents.py:retry",
                    "data": str(ROOT / "tests/data/questions.jsonl"),
                },
            },
            {
                "name": "gym",
                "task": {
                    "name": "reasoning-gym",
                    "dataset": "chain_sum",
                    "answer": "final",
                    "config": {"min_terms": 2, "max_terms": 2},
                },
            },
        ],
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    res = subprocess.run(
        [sys.executable, "-m", "orbit.cli", "sweep", str(path), "--quiet"],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    for run in ("agent", "gym"):
        rows = run_metrics(tmp_path / "sweep" / run)
        assert len(rows) == STEPS and all(r["trained_tokens"] > 0 for r in rows)
        diffs = [r["logprob_diff"] for r in rows]
        print(f"\n{backend} {run}: logprob_diff {diffs}")
        assert all(d is not None and d < LOGPROB_DIFF_MAX for d in diffs), diffs
    agent = run_metrics(tmp_path / "sweep" / "agent")
    assert all(r["episodes_lost"] == 0 for r in agent)
