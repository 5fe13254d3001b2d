"""Directories written whole or not at all: the files go into a temporary directory beside the
target, which is then renamed into place, so a reader (a server loading an adapter, a `--resume`
after a kill) sees the old directory or the new one, never half of one. Checkpoints also flush every
file to disk first (`durable`)."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path


def fsync(path: Path) -> None:
    """Flush a file's (or a directory's entries') writes to disk: a node that dies keeps them
    too."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_dir(
    target: Path, fill: Callable[[Path], object], durable: bool = False, replace: bool = False
) -> Path:
    """`fill(tmp)` writes the files; `tmp` then becomes `target` by one rename. `replace`: an
    existing target is removed first (else the rename fails on it). On any failure the temporary
    directory goes and the error goes on; the target is as it was."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.{uuid.uuid4().hex[:8]}.tmp"
    tmp.mkdir()
    try:
        fill(tmp)
        if durable:
            for file in tmp.iterdir():
                fsync(file)
            fsync(tmp)
        if replace and target.exists():
            shutil.rmtree(target)
        os.rename(tmp, target)
        if durable:
            fsync(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
