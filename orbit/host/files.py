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


def cache_root() -> Path:
    """Where Orbit keeps what it can build again (warm starts, base evaluations): $ORBIT_CACHE,
    or `.cache` under the working directory."""
    return Path(os.environ.get("ORBIT_CACHE", ".cache"))


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
    existing target is first renamed aside and removed once the new one is in place, so a kill at
    any moment leaves the old directory or the new one (`recover_dir` puts an old one back that a
    kill left aside). On any failure the temporary directory goes and the error goes on; the target
    is as it was."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    tmp = target.parent / f".{target.name}.{tag}.tmp"
    aside = target.parent / f".{target.name}.{tag}.old"
    tmp.mkdir()
    try:
        fill(tmp)
        if durable:
            for file in tmp.iterdir():
                fsync(file)
            fsync(tmp)
        if replace and target.exists():
            os.rename(target, aside)
        os.rename(tmp, target)
        if durable:
            fsync(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if aside.exists() and not target.exists():
            os.rename(aside, target)
        raise
    shutil.rmtree(aside, ignore_errors=True)
    return target


def recover_dir(parent: Path) -> None:
    """What a kill in the middle of `write_dir` left in `parent`: half-written temporary
    directories go, and an old directory set aside for a replacement that never arrived is put
    back."""
    if not parent.is_dir():
        return
    for entry in parent.iterdir():
        name = entry.name
        if not (name.startswith(".") and entry.is_dir()):
            continue
        if name.endswith(".tmp"):
            shutil.rmtree(entry, ignore_errors=True)
        elif name.endswith(".old"):
            target = parent / name[1:].rsplit(".", 2)[0]
            if target.exists():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                os.rename(entry, target)
