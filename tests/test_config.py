"""Bad recipes and bad flags fail before any compute, naming the field, value and what is
allowed."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from orbit.cli import app
from orbit.config import RecipeError, load_recipe, parse_recipe
from orbit.config.modes import MODES
from orbit.run.preflight import preflight


def _write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_defaults_are_valid(tiny_llama):
    r = preflight(parse_recipe({"model": str(tiny_llama)})).recipe
    assert r.mode == "double-buffer" and r.engine.backend == "embedded"


def test_repo_recipes_are_valid(tiny_llama):
    import torch

    for path in Path(__file__).resolve().parent.parent.glob("recipes/*.yaml"):
        model = {"model": str(tiny_llama)}
        if "cuda" in path.read_text() and not torch.cuda.is_available():
            # a GPU recipe on this CPU machine: refused at load, naming the device field ...
            with pytest.raises(RecipeError, match=r"device: cuda(:\d)? does not exist"):
                preflight(load_recipe(path, model))
            # ... and valid in every other respect
            preflight(load_recipe(path, {**model, "engine.device": "cpu", "trainer.device": "cpu"}))
        else:
            preflight(load_recipe(path, model))


@pytest.mark.parametrize(
    "patch, expected",
    [
        ({"adapter": {"type": "lorx"}}, ["adapter.type", "'lora' or 'oft'", "lorx"]),
        ({"adapter": {"rank": 3}}, ["adapter.rank", "unknown key"]),
        ({"bogus": 1}, ["bogus", "unknown key"]),
        (
            {"engine": {"max_inflight": 0}},
            ["engine.max_inflight", "greater than or equal to 1", "0"],
        ),
        (
            {"engine": {"backend": "vllm"}},
            ["engine.backend", "'embedded'", "'sglang-server'", "'vllm'"],
        ),
        ({"rollout": {"top_p": 1.5}}, ["rollout.top_p", "1.5"]),
        ({"rollout": {"group_size": "four"}}, ["rollout.group_size", "four"]),
        ({"mode": "turbo"}, ["mode", "double-buffer", "turbo"]),
        ({"trainer": {"lr": -1}}, ["trainer.lr", "-1"]),
        ({"adapter": {"target_modules": ["qkv"]}}, ["adapter.target_modules", "q_proj", "qkv"]),
        ({"engine": {"device": "tpu"}}, ["engine.device", "tpu"]),
        ({"max_staleness": -1}, ["max_staleness", "-1"]),
    ],
)
def test_bad_field_names_field_value_and_allowed(tiny_llama, patch, expected):
    with pytest.raises(RecipeError) as err:
        parse_recipe({"model": str(tiny_llama), **patch})
    for text in expected:
        assert text in str(err.value)


def test_missing_model_path():
    with pytest.raises(RecipeError, match="model: no such directory"):
        preflight(parse_recipe({"model": "/nonexistent/model"}))
    with pytest.raises(RecipeError, match="model: required field is missing"):
        parse_recipe({})


def test_drop_without_replenish_is_rejected(tiny_llama):
    with pytest.raises(RecipeError, match="drop stale groups without replacing them"):
        parse_recipe(
            {"model": str(tiny_llama), "max_staleness": 1, "rollout": {"replenish": False}}
        )
    parse_recipe({"model": str(tiny_llama), "max_staleness": None, "rollout": {"replenish": False}})
    # serial modes never drop (every batch is fresh): nothing to replenish, nothing to refuse
    for mode in ("sync", "sync-adapter"):
        parse_recipe(
            {
                "model": str(tiny_llama),
                "mode": mode,
                "max_staleness": 1,
                "rollout": {"replenish": False},
            }
        )


@pytest.mark.parametrize(
    "problem, message",
    [
        (
            "no weights",
            "has no weights (expected model.safetensors or model.safetensors.index.json)",
        ),
        ("no tokenizer", "has no tokenizer (expected tokenizer.json or tokenizer_config.json)"),
        ("gpt2", "is a 'gpt2' model; the embedded engine runs llama, qwen2, qwen3"),
    ],
)
@pytest.mark.slow
def test_a_bad_model_directory_is_one_line(tmp_path, tiny_llama, problem, message):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    if problem == "no weights":
        (model / "model.safetensors").unlink()
    elif problem == "no tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (model / name).unlink(missing_ok=True)
    else:
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "model_type": problem}))
    with pytest.raises(RecipeError) as err:
        preflight(parse_recipe({"model": str(model)}))
    assert str(err.value) == f"model: {str(model)!r} {message}" or message in str(err.value)
    assert str(model) in str(err.value) and "\n" not in str(err.value)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"model": str(model), "out": str(tmp_path / "run")}))
    res = _orbit("train", str(recipe))
    assert (
        res.returncode == 2
        and "Traceback" not in res.stderr
        and message in " ".join(res.stderr.split())
    )
    assert not (tmp_path / "run").exists()


def test_group_larger_than_inflight_is_rejected(tiny_llama):
    with pytest.raises(RecipeError, match="engine.max_inflight"):
        parse_recipe(
            {"model": str(tiny_llama), "engine": {"max_inflight": 2}, "rollout": {"group_size": 4}}
        )


def test_not_yaml_and_not_found(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(bad)
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "missing.yaml")


def test_modes_are_rows_of_loop_and_push():
    assert {(m.loop, m.push) for m in MODES.values()} == {
        ("serial", "full"),
        ("serial", "adapter"),
        ("overlapped", "full"),
        ("overlapped", "adapter"),
        ("overlapped", "double-buffer"),
    }


def _orbit(*args: str) -> subprocess.CompletedProcess:
    """`orbit ARGS` in this process (typer's runner: the same exit code and streams, without an
    interpreter importing torch again for each command)."""
    res = CliRunner().invoke(app, list(args))
    return subprocess.CompletedProcess(["orbit", *args], res.exit_code, res.stdout, res.stderr)


@pytest.mark.slow
def test_cli_recipe_check(tmp_path, tiny_llama):
    good = _write(tmp_path, {"model": str(tiny_llama)})
    res = _orbit("recipe", "check", str(good))
    assert (
        res.returncode == 0
        and "algorithm: dapo (advantage grpo, aggregation token-mean, ratio clip"
        in " ".join(res.stdout.split())
    )
    old = _write(tmp_path, {"model": str(tiny_llama), "algorithm": {"preset": "orbit_v1"}})
    out = " ".join(_orbit("recipe", "check", str(old)).stdout.split())
    assert "algorithm: orbit_v1 (advantage grpo, aggregation token-mean, ratio truncate" in out
    dapo = _write(
        tmp_path, {"model": str(tiny_llama), "algorithm": {"preset": "dapo", "clip_eps_high": 0.3}}
    )
    # the resolved settings, unwrapped
    out = " ".join(_orbit("recipe", "check", str(dapo)).stdout.split())
    assert "algorithm: dapo (" in out and "clip_eps_high 0.3," in out and "overlong_buffer 6" in out
    bad = _write(tmp_path, {"model": str(tiny_llama), "rollout": {"temperature": 0}})
    res = _orbit("recipe", "check", str(bad))
    assert res.returncode == 2 and "rollout.temperature" in res.stderr


@pytest.mark.slow
def test_cli_train_bad_flags_fail_before_compute(tmp_path, tiny_llama):
    recipe = _write(tmp_path, {"model": str(tiny_llama), "out": str(tmp_path / "run")})
    res = _orbit("train", str(recipe), "--mode", "turbo")
    assert res.returncode == 2 and "turbo" in res.stderr
    res = _orbit("train", str(recipe), "--steps", "0")
    assert res.returncode == 2 and "trainer.steps" in res.stderr
    res = _orbit("train", str(recipe), "--resume", str(tmp_path / "nothing-here"))
    assert res.returncode == 2 and "no checkpoint" in res.stderr
    assert not (tmp_path / "run").exists()  # nothing was created or computed
    for timeout in ("5", "nan"):  # orbit serve: a session must outlive the SDK's 10 s heartbeat
        res = _orbit("serve", str(recipe), "--session-timeout", timeout, "--dir", str(tmp_path))
        assert res.returncode == 2 and "--session-timeout" in res.stderr, res.stderr
    # a second base model that is not there: named by its place, before any engine starts
    serve = {"models": [{"model": str(tmp_path / "teacher"), "names": ["t"]}]}
    two = _write(tmp_path, {"model": str(tiny_llama), "serve": serve})
    res = _orbit("serve", str(two), "--dir", str(tmp_path / "serve"))
    assert res.returncode == 2 and "serve.models[0].model: no such directory" in res.stderr
    assert not (tmp_path / "serve").exists()


@pytest.mark.slow
def test_cli_model_tiny_loads_with_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    res = _orbit("model", "tiny", str(tmp_path / "m"), "--arch", "qwen2", "--seed", "3")
    assert res.returncode == 0, res.stderr
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert model.config.model_type == "qwen2" and tok.eos_token == "<eos>"
    assert _orbit("model", "tiny", str(tmp_path / "x"), "--arch", "gpt2").returncode == 2


def test_oft_block_size_must_divide_targets(tiny_llama):
    with pytest.raises(
        RecipeError, match=r"adapter.oft_block_size: 7 .* allowed: \[2, 4, 8, 16, 32\]"
    ):
        preflight(
            parse_recipe(
                {
                    "model": str(tiny_llama),
                    "adapter": {
                        "type": "oft",
                        "oft_block_size": 7,
                        "target_modules": ["q_proj", "down_proj"],
                    },
                }
            )
        )
    preflight(
        parse_recipe({"model": str(tiny_llama), "adapter": {"type": "oft", "oft_block_size": 16}})
    )


@pytest.mark.slow
def test_stop_strings_must_be_single_tokens(tmp_path, tiny_llama):
    from transformers import AutoTokenizer

    from orbit.run.lifecycle import train
    from orbit.run.preflight import stop_token_ids

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    assert stop_token_ids(tok, ["=", "]"]) == (
        tok.eos_token_id,
        tok.encode("=")[0],
        tok.encode("]")[0],
    )
    recipe = preflight(
        parse_recipe(
            {
                "model": str(tiny_llama),
                "rollout": {"stop": ["no such stop word"]},
                "out": str(tmp_path / "run"),
            }
        )
    )
    with pytest.raises(RecipeError, match="rollout.stop: 'no such stop word' is .* tokens"):
        train(recipe, live=False)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_small_size_preset(tmp_path):
    from transformers import AutoConfig

    from orbit.models.tiny import build_tiny_model

    cfg = AutoConfig.from_pretrained(build_tiny_model(tmp_path / "s", size="small"))
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads) == (256, 4, 4)
    with pytest.raises(ValueError, match="size must be one of"):
        build_tiny_model(tmp_path / "x", size="huge")
