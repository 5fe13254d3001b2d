"""Watching a run: samples.jsonl, TensorBoard and W&B (offline) see what metrics.jsonl says."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from run_helpers import checked, read_jsonl, recipe_dict, run_metrics

import orbit.run.lifecycle
import orbit.run.trackers
from orbit.config import RecipeError, parse_recipe
from orbit.run.lifecycle import train
from orbit.run.trackers import log_images, scalars

pytestmark = pytest.mark.slow  # end-to-end: `make test-fast` leaves it out

SAMPLE_FIELDS = {
    "step",
    "version",
    "prompt",
    "completion",
    "reward",
    "failure_mode",
    "correct",
    "format_ok",
}


def _recipe(model: Path, out: Path, **patch) -> dict:
    return recipe_dict(
        model,
        out,
        {
            "rollout": {"max_new_tokens": 8},
            "trainer": {"save_every": 3},
            "task": {
                "name": "tests/user_tasks.py:count_word"
            },  # says correct, format_ok, failure_mode
            "mode": "sync-adapter",
        },
        **patch,
    )


def _offline_wandb(mp: pytest.MonkeyPatch, root: Path) -> None:
    """W&B without network or a key, and nothing written outside the test's directory."""
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    for var, sub in (
        ("WANDB_DIR", "dir"),
        ("WANDB_CACHE_DIR", "cache"),
        ("WANDB_CONFIG_DIR", "config"),
        ("WANDB_DATA_DIR", "data"),
        ("WANDB_ARTIFACT_DIR", "artifacts"),
    ):
        mp.setenv(var, str(root / sub))
    mp.delenv("WANDB_API_KEY", raising=False)
    mp.setenv("WANDB_PROJECT", "orbit-test")


@pytest.fixture(scope="module")
def tracked(tmp_path_factory, tiny_llama) -> Path:
    """One 3-step run logging to both trackers."""
    root = tmp_path_factory.mktemp("tracked")
    with pytest.MonkeyPatch.context() as mp:
        _offline_wandb(mp, root)
        recipe = checked(_recipe(tiny_llama, root / "run", logging=["tensorboard", "wandb"]))
        assert train(recipe, live=False).steps_done == 3
    return root / "run"


def _events(log_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    acc.Reload()
    return acc


def test_tensorboard_has_every_numeric_metric_per_step_and_the_samples(tracked):
    acc = _events(tracked / "tensorboard")
    rows = run_metrics(tracked)
    expected = [scalars(r) for r in rows]
    assert "failure_modes/success" in expected[0] or "failure_modes/wrong_answer" in expected[0]
    assert {"step_s", "reward_mean", "loss", "full_push"} <= set(expected[0])  # numbers and bools
    for name in set().union(*expected):
        logged = {e.step: e.value for e in acc.Scalars(name)}
        want = {r["step"]: x[name] for r, x in zip(rows, expected, strict=True) if name in x}
        assert set(logged) == set(want), name
        for step, value in want.items():
            assert logged[step] == pytest.approx(value, rel=1e-6, abs=1e-6), (name, step)
    assert "mode" not in acc.Tags()["scalars"] and "adapter_transport" not in acc.Tags()["scalars"]
    texts = acc.Tensors("samples/text_summary")
    assert [t.step for t in texts] == [0, 1, 2]
    table = texts[-1].tensor_proto.string_val[0].decode()
    assert table.startswith("| step | version |") and "completion" in table
    last = [s for s in read_jsonl(tracked / "samples.jsonl") if s["step"] == 2]
    assert all(f"| {s['reward']} |" in table for s in last)


def _wandb_records(path: Path):
    """The records of a .wandb file (a LevelDB-style log of protobuf records: 32 KiB blocks, each
    chunk `crc32 | length | type`, after a 7-byte header). wandb 0.2x+ has no Python reader of
    it."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, record = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        record = chunk if kind in (1, 2) else record + chunk  # FULL, FIRST | MIDDLE, LAST
        if kind in (1, 4):
            parsed = pb.Record()
            parsed.ParseFromString(record)
            yield parsed


def test_wandb_offline_run_holds_the_metrics_config_and_samples(tracked):
    runs = list((tracked / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    records = list(_wandb_records(next(runs[0].glob("*.wandb"))))
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.display_name == "run" and run.project == "orbit-test"
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["mode"] == "sync-adapter" and config["logging"] == ["tensorboard", "wandb"]
    assert config["rollout"]["group_size"] == 4  # the recipe, nested as dumped
    history = [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert [h["_step"] for h in history] == [0, 1, 2]
    for h, row in zip(history, run_metrics(tracked), strict=True):
        for name, value in scalars(row).items():
            assert h[name] == pytest.approx(value, rel=1e-9), name
        assert h["samples/_type"] == "table-file"
    assert len(list((runs[0] / "files" / "media" / "table").glob("samples_*.table.json"))) == 3


def test_samples_jsonl_has_a_few_decoded_samples_per_step(tracked):
    samples = read_jsonl(tracked / "samples.jsonl")
    assert sorted({s["step"] for s in samples}) == [0, 1, 2]
    for step in range(3):
        mine = [s for s in samples if s["step"] == step]
        assert 1 <= len(mine) <= orbit.run.trackers.SAMPLES_PER_STEP
        # one per group first (2 groups a step)
        assert len({s["group"] for s in mine}) == min(len(mine), 2)
    for s in samples:
        assert SAMPLE_FIELDS <= set(s), s
        assert (
            s["prompt"].strip().startswith("yes")
            and isinstance(s["completion"], str)
            and s["completion"]
        )
        assert s["failure_mode"] in ("success", "wrong_answer") and s["format_ok"] is True
        assert s["version"] == s["step"]  # sync-adapter: every sample is of the version it trains


@pytest.mark.parametrize(
    "logging, message",
    [
        (["tensorboard", "tensorboard"], "logging: 'tensorboard' is listed more than once"),
        (["mlflow"], r"logging\.0: .*'tensorboard' or 'wandb'.*mlflow"),
    ],
)
def test_a_bad_logging_list_fails_at_parse(tmp_path, tiny_llama, logging, message):
    with pytest.raises(RecipeError, match=message):
        checked(_recipe(tiny_llama, tmp_path / "run", logging=logging))


def test_a_tracker_not_installed_fails_at_parse_with_the_install_command(
    tmp_path, tiny_llama, monkeypatch
):
    monkeypatch.setitem(
        orbit.run.trackers.TRACKERS, "wandb", ("no_such_module_orbit", "pip install wandb")
    )
    with pytest.raises(
        RecipeError, match=r"logging: 'wandb' cannot run: .*not installed.*pip install wandb"
    ):
        checked(_recipe(tiny_llama, tmp_path / "run", logging=["wandb"]))


def test_a_tracker_that_cannot_start_fails_the_start_and_leaves_nothing(
    tmp_path, tiny_llama, monkeypatch
):
    def no_key(*args, **kwargs):
        raise RuntimeError("api_key not configured (no-tty)")

    monkeypatch.setattr(orbit.run.trackers._WandB, "__init__", no_key)
    run_dir = tmp_path / "run"
    recipe = checked(_recipe(tiny_llama, run_dir, logging=["tensorboard", "wandb"]))
    with pytest.raises(
        RecipeError, match=r"logging: 'wandb' could not start: .*api_key.*WANDB_MODE=offline"
    ):
        train(recipe, live=False)
    assert not run_dir.exists()  # the tensorboard directory it had opened went too


def test_a_tracker_failing_mid_run_warns_once_and_training_goes_on(
    tmp_path, tiny_llama, monkeypatch
):
    from torch.utils.tensorboard import SummaryWriter

    calls = []

    def broken(self, *args, **kwargs):
        calls.append(args[0])
        raise OSError("No space left on device")

    monkeypatch.setattr(SummaryWriter, "add_scalar", broken)
    run_dir = tmp_path / "run"
    assert (
        train(checked(_recipe(tiny_llama, run_dir, logging=["tensorboard"])), live=False).steps_done
        == 3
    )
    # tried every step
    assert [r["step"] for r in run_metrics(run_dir)] == [0, 1, 2] and len(calls) == 3
    log = (run_dir / "run.log").read_text()
    assert log.count("WARNING") == 1 and "tensorboard: OSError: No space left on device" in log
    assert {s["step"] for s in read_jsonl(run_dir / "samples.jsonl")} == {0, 1, 2}


def test_without_logging_samples_are_written_and_a_resume_keeps_them_in_step(tmp_path, tiny_llama):
    run_dir = tmp_path / "run"
    train(checked(_recipe(tiny_llama, run_dir, trainer={"steps": 2, "save_every": 2})), live=False)
    assert not (run_dir / "tensorboard").exists() and not (run_dir / "wandb").exists()
    # as if the run had gone on to step 2 and died before its checkpoint
    with (run_dir / "samples.jsonl").open("a") as f:
        f.write(json.dumps({"step": 2, "version": 2, "completion": "lost"}) + "\n")
    train(
        checked(_recipe(tiny_llama, run_dir, trainer={"steps": 3, "save_every": 2})),
        resume=True,
        live=False,
    )
    steps = [s["step"] for s in read_jsonl(run_dir / "samples.jsonl")]
    assert (
        steps == sorted(steps)
        and set(steps) == {0, 1, 2}
        and "lost" not in (run_dir / "samples.jsonl").read_text()
    )
    assert [s["completion"] for s in read_jsonl(run_dir / "samples.discarded.jsonl")] == ["lost"]


def test_bench_figures_go_to_the_trackers(tmp_path, tiny_llama, monkeypatch):
    from PIL import Image

    _offline_wandb(monkeypatch, tmp_path)
    png = tmp_path / "panels.png"
    Image.new("RGB", (32, 16), (200, 30, 30)).save(png)
    recipe = parse_recipe(
        _recipe(tiny_llama, tmp_path / "unused", logging=["tensorboard", "wandb"])
    )
    log_images(recipe, tmp_path / "bench" / "tracking", {"panels/embedded": png}, name="bench")
    image = _events(tmp_path / "bench" / "tracking" / "tensorboard").Images("panels/embedded")[0]
    assert (image.width, image.height) == (32, 16)
    wandb_run = next((tmp_path / "bench" / "tracking" / "wandb").glob("offline-run-*"))
    assert list((wandb_run / "files" / "media" / "images").rglob("*.png"))
    log_images(
        parse_recipe(_recipe(tiny_llama, tmp_path / "x")), tmp_path / "none", {"panels": png}
    )
    assert not (tmp_path / "none").exists()  # no `logging`: nothing
