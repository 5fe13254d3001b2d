"""Checkpoints that survive a kill (orbit/train/checkpoint.py): each save a new directory made
current by one rename, `keep_last` of them kept, `adapter` naming the newest, a failing save keeping
the previous one, and SIGKILL at every point of a save followed by --resume giving exactly the run
never stopped."""

from __future__ import annotations

import errno
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from run_helpers import checked, recipe_dict, run_metrics
from safetensors.torch import load_file

from orbit.run import RunStopped, train
from orbit.train import checkpoint

# A serial run is exact: resumed, it gives what the run never stopped gives
# (tests/test_hardening.py).
SERIAL = {"mode": "sync-adapter", "adapter": {"dropout": 0.1}, "rollout": {"max_new_tokens": 10}}


def _writer(files: dict[str, str]):
    def write(directory: Path) -> None:
        for name, text in files.items():
            (directory / name).write_text(text)

    return write


def _state(version: int) -> dict[str, str]:
    return {
        "adapter_model.safetensors": "x",
        checkpoint.STATE_FILE: json.dumps({"version": version}),
    }


def test_each_save_is_a_new_directory_and_adapter_names_the_newest(tmp_path):
    for version in (2, 4, 6, 8):
        checkpoint.save(tmp_path, version, _writer(_state(version)), keep_last=2)
        assert (tmp_path / "adapter").resolve() == checkpoint.step_dir(tmp_path, version).resolve()
    assert [v for v, _ in checkpoint.checkpoints(tmp_path)] == [6, 8]  # keep_last
    assert checkpoint.latest(tmp_path) == checkpoint.step_dir(tmp_path, 8)
    # the same step again (a stop right after its periodic save): nothing rewritten
    checkpoint.save(tmp_path, 8, _writer({"broken": "!"}), keep_last=2)
    assert not (checkpoint.step_dir(tmp_path, 8) / "broken").exists()


def test_a_failed_save_says_so_in_one_line_and_keeps_the_previous(tmp_path):
    checkpoint.save(tmp_path, 1, _writer(_state(1)), keep_last=3)

    def disk_full(directory: Path) -> None:
        (directory / "adapter_model.safetensors").write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.save(tmp_path, 2, disk_full, keep_last=3)
    message = str(err.value)
    assert "\n" not in message and "No space left on device" in message
    assert "the checkpoint of step 1 is kept" in message
    assert checkpoint.latest(tmp_path) == checkpoint.step_dir(tmp_path, 1)
    # its half-written temporary directory is gone
    assert not list((tmp_path / "checkpoints").glob(".*"))


def test_an_older_runs_adapter_directory_is_resumed_and_adopted(tmp_path):
    legacy = tmp_path / "adapter"
    legacy.mkdir()
    _writer(_state(5))(legacy)
    assert checkpoint.latest(tmp_path) == legacy
    checkpoint.save(tmp_path, 6, _writer(_state(6)), keep_last=3)
    assert [v for v, _ in checkpoint.checkpoints(tmp_path)] == [5, 6] and (
        tmp_path / "adapter"
    ).is_symlink()


@pytest.mark.slow
def test_a_full_disk_mid_run_stops_with_one_line_and_the_run_resumes(
    tmp_path, tiny_llama, monkeypatch
):
    run_dir = tmp_path / "run"
    real = checkpoint.save

    def full_from_step_3(run_dir, version, write, keep_last):
        if version >= 3:
            raise checkpoint.CheckpointError(
                f"could not write the checkpoint of step {version} to ... (No space left on "
                "device); the checkpoint of step 2 is kept"
            )
        return real(run_dir, version, write, keep_last)

    monkeypatch.setattr(checkpoint, "save", full_from_step_3)
    with pytest.raises(RunStopped) as err:
        train(
            checked(recipe_dict(tiny_llama, run_dir, trainer={"steps": 5, "save_every": 1})),
            live=False,
        )
    assert "No space left on device" in str(err.value) and "--resume" in str(err.value)
    assert checkpoint.latest(run_dir) == checkpoint.step_dir(run_dir, 2)
    monkeypatch.undo()
    train(
        checked(recipe_dict(tiny_llama, run_dir, trainer={"steps": 5, "save_every": 1})),
        resume=True,
        live=False,
    )
    assert [r["step"] for r in run_metrics(run_dir)] == [0, 1, 2, 3, 4]


# ---- SIGKILL inside a save -----------------------------------------------------------------------

DRIVER = """
import sys, time, os
import orbit.host.files as files
import orbit.train.checkpoint as ckpt
from orbit.train.trainer import Trainer

at = {"version": 0, "mark": 0}
def mark(what):
    at["mark"] += 1
    print(f"MARK {at['version']} {at['mark']} {what}", flush=True)
    time.sleep(0.2)

real_save, real_fsync, real_rename, real_replace = Trainer.save, files.fsync, os.rename, os.replace
def save(self, directory, run_state=None):
    at["version"], at["mark"] = self.version, 0
    mark("writing"); out = real_save(self, directory, run_state); mark("written"); return out
def fsync(path):
    real_fsync(path); mark(f"fsync {os.path.basename(path)}")
class Os:
    def __getattr__(self, name): return getattr(os, name)
    def rename(self, a, b): real_rename(a, b); mark("renamed")
    def replace(self, a, b): real_replace(a, b); mark("latest")
if __name__ == "__main__":  # (the engine's spawned process imports this file too)
    Trainer.save, files.fsync, ckpt.fsync, files.os, ckpt.os = save, fsync, fsync, Os(), Os()
    from orbit.cli import app
    sys.argv = ["orbit", "train", sys.argv[1], "--quiet"]
    app()
"""


def _run_killed_at(recipe: Path, mark: int, tmp_path: Path) -> bool:
    """Run the recipe under the driver and SIGKILL it at the `mark`-th point of its first save (step
    2); False when that save has no such point (the run went on past it)."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    proc = subprocess.Popen(
        [sys.executable, str(driver), str(recipe)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        for line in proc.stdout:
            if line.startswith(f"MARK 2 {mark} "):
                proc.send_signal(signal.SIGKILL)
                proc.wait(30)
                return True
            if line.startswith("MARK 4 "):
                return False
        return False
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_mid_save_then_resume_is_the_run_never_stopped(tmp_path, tiny_llama):
    """The first save (step 2 of 4) is cut at its points (its 12 marks: writing, written, five files
    flushed, the directory flushed, renamed, its parent flushed, the newest pointer, the run
    directory flushed), at the two that leave the states on disk a resume must deal with (a
    temporary directory; the new checkpoint with the old pointer): every time --resume starts from a
    complete checkpoint (step 2 once its rename was reached, else the start) and ends with the
    metrics and the adapter of the run never stopped: no step lost, none repeated."""
    whole = tmp_path / "whole"
    train(
        checked(recipe_dict(tiny_llama, whole, SERIAL, trainer={"steps": 4, "save_every": 2})),
        live=False,
    )
    want = load_file(whole / "adapter" / "adapter_model.safetensors")
    points = 0
    for mark in (5, 9):  # mid-flush (not renamed); renamed, the pointer still old
        run_dir = tmp_path / f"k{mark}"
        data = recipe_dict(tiny_llama, run_dir, SERIAL, trainer={"steps": 4, "save_every": 2})
        recipe = tmp_path / f"k{mark}.yaml"
        recipe.write_text(yaml.safe_dump(data))
        assert _run_killed_at(recipe, mark, tmp_path), f"the save has no point {mark}"
        points += 1
        assert not list((run_dir / "checkpoints").glob("step-*[!0-9]*")), (
            "a torn checkpoint directory"
        )
        latest = checkpoint.latest(run_dir)
        if latest is not None:
            assert json.loads((latest / "trainer_state.json").read_text())["version"] == 2
        train(checked(data), resume=True, live=False)  # no complete checkpoint yet: from step 0
        rows = run_metrics(run_dir)
        assert [r["step"] for r in rows] == [0, 1, 2, 3], (
            f"kill point {mark}: steps {[r['step'] for r in rows]}"
        )
        got = load_file(run_dir / "adapter" / "adapter_model.safetensors")
        assert all(torch.allclose(got[k], want[k], atol=1e-5) for k in want), f"kill point {mark}"
        assert not list((run_dir / "checkpoints").glob(".*")), "a save's leftovers were not cleaned"
    assert points == 2
