"""Checkpoints that survive a kill: each save is a new directory, made current by one rename.

    RUN_DIR/checkpoints/step-000020/   adapter_model.safetensors, adapter_config.json (peft's
    format),
                                       optimizer.pt, trainer_state.json: always from the same step
    RUN_DIR/adapter -> checkpoints/step-000020    the newest complete one (a symlink)

A save writes every file into a temporary directory beside the others, flushes them to disk, and
renames the directory to `step-N`: a kill at any point leaves either the whole new checkpoint or
none of it (a leftover temporary directory is removed by the next `--resume`). Then `adapter` is
pointed at it, again by one rename, and all but the newest `keep_last` are deleted. A save that
fails (a full disk, a directory that cannot be written) removes what it wrote and says so in one
line; the previous checkpoint stays current. `latest` finds the newest complete one for `--resume`.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from orbit.host.files import fsync, write_dir

CHECKPOINTS = "checkpoints"
LATEST = "adapter"
STATE_FILE = "trainer_state.json"  # written last by the trainer; a complete checkpoint has it
_STEP = re.compile(r"^step-(\d{6,})$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the previous one is kept. The message says both in one
    line."""


def step_dir(run_dir: Path, version: int) -> Path:
    return run_dir / CHECKPOINTS / f"step-{version:06d}"


def checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(version, directory) of every complete checkpoint, oldest first."""
    root = run_dir / CHECKPOINTS
    found = []
    for path in root.iterdir() if root.is_dir() else ():
        m = _STEP.match(path.name)
        if m and (path / STATE_FILE).is_file():
            found.append((int(m.group(1)), path))
    return sorted(found)


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run (a run of an older Orbit: its `adapter/`
    directory)."""
    found = checkpoints(run_dir)
    if found:
        return found[-1][1]
    legacy = run_dir / LATEST
    return (
        legacy
        if legacy.is_dir() and not legacy.is_symlink() and (legacy / STATE_FILE).is_file()
        else None
    )


def save(run_dir: Path, version: int, write: Callable[[Path], object], keep_last: int) -> Path:
    """Write the checkpoint of `version` (`write(directory)` puts the files there) and make it
    current."""
    final = step_dir(run_dir, version)
    previous = latest(run_dir)
    kept = (
        f"the checkpoint of step {_version_of(previous)} is kept"
        if previous
        else "no checkpoint was kept"
    )
    # (a stop right after a periodic save of the same step: it is there)
    if not (final / STATE_FILE).is_file():
        try:
            _adopt_legacy(run_dir)
            write_dir(final, write, durable=True)
        except OSError as err:
            raise CheckpointError(
                f"could not write the checkpoint of step {version} to {final} "
                f"({err.strerror or err}); {kept}"
            ) from None
    _point_latest(run_dir, final)
    _prune(run_dir, keep_last, keep=final)
    return final


def clean_partial(run_dir: Path) -> None:
    """Remove what a save killed part-way left: its temporary directory (never a complete
    checkpoint)."""
    root = run_dir / CHECKPOINTS
    for path in root.glob(".step-*.tmp") if root.is_dir() else ():
        shutil.rmtree(path, ignore_errors=True)
    for path in run_dir.glob(f".{LATEST}.*.tmp"):
        path.unlink(missing_ok=True)


def _point_latest(run_dir: Path, target: Path) -> None:
    """`adapter` -> target, replaced in one rename (a reader sees the old or the new, never
    neither)."""
    link = run_dir / f".{LATEST}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        link.symlink_to(target.relative_to(run_dir))
        os.replace(link, run_dir / LATEST)
        fsync(run_dir)
    except OSError as err:
        link.unlink(missing_ok=True)
        raise CheckpointError(
            f"could not point {run_dir / LATEST} at {target} ({err.strerror or err}); the "
            f"checkpoint itself is complete in {target}"
        ) from None


def _adopt_legacy(run_dir: Path) -> None:
    """A run of an older Orbit kept its one checkpoint in `adapter/` itself: move it among the
    others."""
    legacy = latest(run_dir)
    if legacy is not None and legacy.name == LATEST:
        target = step_dir(run_dir, _version_of(legacy))
        target.parent.mkdir(parents=True, exist_ok=True)
        os.rename(legacy, target)


def _prune(run_dir: Path, keep_last: int, keep: Path) -> None:
    for _, path in checkpoints(run_dir)[:-keep_last] if keep_last > 0 else ():
        if path != keep:
            shutil.rmtree(path, ignore_errors=True)


def _version_of(path: Path) -> int:
    import json

    return int(json.loads((path / STATE_FILE).read_text())["version"])
