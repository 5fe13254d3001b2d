"""Directories of one Orbit process, removed when it ends, or by the next Orbit when it could not.

`claim()` (every `orbit` command) points TMPDIR at a fresh /tmp/orbit-scratch-<pid>-*: what Orbit,
the libraries it drives and every process it starts put in temporary files lands there (SGLang's
ZeroMQ socket files, multiprocessing's `pymp-*` directories), and none of them removes its own
when killed. The directory goes at exit; one whose process is gone (SIGKILL, the OOM killer) is
removed by the next Orbit. `own_dir` makes such a directory anywhere (adapter files in /dev/shm).

multiprocessing's named semaphores (/dev/shm/sem.mp-*, a queue's locks) are removed by its resource
tracker when their process dies, but a kill of the whole process group kills the tracker too: their
names are noted in the scratch directory as they are made, and the next Orbit unlinks them with it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

SCRATCH = "orbit-scratch-"
NOTED = "shm-names"  # in a scratch directory: "<kind> <name>" of what its process made in /dev/shm


def own_dir(prefix: str, base: Path) -> Path:
    """A fresh `base/<prefix><pid>-*` of this process's; those of processes that are gone go
    first."""
    for old in base.glob(f"{prefix}*"):
        pid = old.name[len(prefix) :].split("-")[0]
        if pid.isdigit() and not alive(int(pid)):
            _unlink_noted(old / NOTED)
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=base))


def claim() -> Path:
    """This process's scratch directory as everyone's TMPDIR (module docstring); once per
    process."""
    current = os.environ.get("TMPDIR", "")
    if Path(current).name.startswith(f"{SCRATCH}{os.getpid()}-"):
        return Path(current)
    # Next to the scratch directory of the Orbit that started this one (a trainer rank's launcher),
    # not in it: socket paths in here (multiprocessing's, ZeroMQ's) must stay under AF_UNIX's 108
    # bytes.
    base = Path(tempfile.gettempdir())
    while base.name.startswith(SCRATCH):
        base = base.parent
    path = own_dir(SCRATCH, base)
    os.environ["TMPDIR"] = tempfile.tempdir = str(path)
    # Removed after multiprocessing's own exit clean-up, which removes its pymp-* directory in here
    # and fails when it is gone: as one of its finalizers, ranked after that one (exitpriority
    # -100).
    from multiprocessing import util

    util.Finalize(None, shutil.rmtree, args=(path, True), exitpriority=-101)
    _note_shm(path / NOTED)
    return path


def _note_shm(noted: Path) -> None:
    """Note in `noted` each name this process registers with multiprocessing's resource tracker
    (every semaphore and shared-memory block it makes), for the next Orbit to unlink if this
    process group is killed whole. SemLock and SharedMemory look `register` up when they call it."""
    from multiprocessing import resource_tracker

    real = resource_tracker.register

    def register(name: Any, rtype: str) -> None:
        with noted.open("a") as f:
            f.write(f"{rtype} {name}\n")
        real(name, rtype)

    resource_tracker.register = register


def _unlink_noted(noted: Path) -> None:
    """Unlink what a dead process noted (those its tracker removed already are gone: skipped)."""
    import _multiprocessing
    import _posixshmem

    unlink = {"semaphore": _multiprocessing.sem_unlink, "shared_memory": _posixshmem.shm_unlink}
    try:
        lines = noted.read_text().splitlines()
    except OSError:
        return
    for line in lines:
        kind, _, name = line.partition(" ")
        if kind in unlink:
            try:
                unlink[kind](name)
            except OSError:
                pass


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
