"""Directories of one Orbit process, removed when it ends, or by the next Orbit when it could not.

`claim()` (every `orbit` command) points TMPDIR at a fresh /tmp/orbit-scratch-<pid>-*: what Orbit,
the libraries it drives and every process it starts put in temporary files lands there (SGLang's
ZeroMQ socket files, multiprocessing's `pymp-*` directories), and none of them removes its own
when killed. The directory goes at exit; one whose process is gone (SIGKILL, the OOM killer) is
removed by the next Orbit. `own_dir` makes such a directory anywhere (adapter files in /dev/shm).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

SCRATCH = "orbit-scratch-"


def own_dir(prefix: str, base: Path) -> Path:
    """A fresh `base/<prefix><pid>-*` of this process's; those of processes that are gone go
    first."""
    for old in base.glob(f"{prefix}*"):
        pid = old.name[len(prefix) :].split("-")[0]
        if pid.isdigit() and not alive(int(pid)):
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
    return path


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
