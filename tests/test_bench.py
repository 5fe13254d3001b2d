"""A short `orbit bench`: all three outputs exist with the expected fields; bad arguments fail clearly."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from orbit.bench import HEADLINE, TIMED, p90, run_bench, summarize
from orbit.config import RecipeError, parse_recipe
from orbit.modes import MODE_NAMES
from orbit.panels import pack_lanes


def _recipe(model, out):
    return parse_recipe({
        "model": str(model),
        "adapter": {"type": "lora", "r": 4, "alpha": 8},
        "engine": {"max_inflight": 16, "max_running": 16},
        "rollout": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 10},
        "out": str(out),
    })


def test_short_bench_writes_summary_table_and_panels(tmp_path, tiny_llama):
    from rich.console import Console

    console = Console(record=True, width=200)
    result = run_bench(_recipe(tiny_llama, tmp_path / "x"), tmp_path / "bench", steps=2, warmup=1, console=console)
    summary = json.loads((tmp_path / "bench" / "summary.json").read_text())
    assert summary == json.loads(json.dumps(result.summary))
    assert list(summary["modes"]) == list(MODE_NAMES)
    for mode, s in summary["modes"].items():
        assert s["steps"] == 2, mode
        for key in TIMED:
            assert s[key]["median"] >= 0 and s[key]["p90"] >= s[key]["median"] * 0.999
        for key in ("staleness_mean", "staleness_max", "stale_dropped", "reward_mean", "waste_frac"):
            assert key in s
    assert summary["modes"]["sync"]["staleness_max"] == 0
    assert summary["ratios"]["double-buffer"]["step_s"]["vs_sync"] > 0
    assert {t["target"] for t in summary["targets"]} and all("met" in t for t in summary["targets"])
    png = (tmp_path / "bench" / "panels.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    text = console.export_text()
    assert all(mode in text for mode in MODE_NAMES) and "vs sync" in text and "%" in text
    for _, label, _ in HEADLINE:
        assert label in text
    assert "useful tok/s" in text and "waste" in text


def test_summary_statistics():
    rows = [{"update_weights_s": v, "train_wait_s": v, "rollout_tok_per_dev_s": v, "useful_tok_per_dev_s": v,
             "step_s": v, "engine_paused_s": v, "staleness_mean": 1.0, "staleness_max": 2, "stale_dropped": 1,
             "reward_mean": 0.5, "logprob_diff": None, "tokens_generated": 100 * v, "waste_frac": 0.1 * (v < 3)}
            for v in (1.0, 2.0, 3.0, 4.0, 10.0)]
    s = summarize(rows)
    assert s["step_s"] == {"median": 3.0, "p90": 10.0}
    assert s["stale_dropped"] == 5 and s["staleness_max"] == 2
    assert s["waste_frac"] == pytest.approx((10 + 20) / 2000)  # token-weighted over the steps
    assert p90([5.0]) == 5.0


def test_lanes_never_overlap():
    reqs = [{"t0": a, "t1": b} for a, b in [(0, 5), (1, 2), (2, 3), (4, 6), (5, 7)]]
    lanes = pack_lanes(reqs)
    for i, (r, lane) in enumerate(zip(reqs, lanes, strict=True)):
        for s, other in zip(reqs[:i], lanes[:i], strict=True):
            assert lane != other or s["t1"] <= r["t0"]


def test_bad_bench_arguments(tmp_path, tiny_llama):
    with pytest.raises(RecipeError, match="--steps"):
        run_bench(_recipe(tiny_llama, tmp_path / "x"), tmp_path / "b", steps=0, warmup=1)
    with pytest.raises(RecipeError, match="--warmup"):
        run_bench(_recipe(tiny_llama, tmp_path / "x"), tmp_path / "b", steps=2, warmup=-1)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"model": str(tiny_llama), "rollout": {"group_size": 1}}))
    res = subprocess.run([sys.executable, "-m", "orbit.cli", "bench", str(recipe), "--out", str(tmp_path / "b")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "rollout.group_size" in res.stderr
    res = subprocess.run([sys.executable, "-m", "orbit.cli", "bench", str(recipe), "--engine", "tgi"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "tgi" in res.stderr
    assert not (tmp_path / "b").exists()


def test_bench_stops_cleanly_on_task_errors_and_ctrl_c(tmp_path, tiny_llama, monkeypatch):
    """A task that fails mid-bench and Ctrl-C both end the bench with one clear line and an exit code."""
    from typer.testing import CliRunner

    import orbit.run
    from orbit.cli import app

    recipe = tmp_path / "r.yaml"
    data = {"model": str(tiny_llama), "adapter": {"r": 4, "alpha": 8},
            "rollout": {"group_size": 2, "prompts_per_step": 2, "max_new_tokens": 6},
            "task": {"name": "tests/user_tasks.py:broken_scorer", "fail_after": 6}}
    recipe.write_text(yaml.safe_dump(data))
    res = CliRunner().invoke(app, ["bench", str(recipe), "--steps", "2", "--warmup", "0", "--out", str(tmp_path / "b")])
    flat = " ".join(res.output.split())
    assert res.exit_code == 1 and "the task failed" in flat and "verifier crashed" in flat, res.output
    assert "Traceback" not in res.output

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(orbit.run, "start_pool", interrupted)
    data["task"] = {"name": "pattern"}
    recipe.write_text(yaml.safe_dump(data))
    res = CliRunner().invoke(app, ["bench", str(recipe), "--steps", "2", "--warmup", "0", "--out", str(tmp_path / "c")])
    assert res.exit_code == 130 and "nothing was trained" in " ".join(res.output.split()), res.output
