"""What Orbit leaves on this host for SGLang, and how nothing of it is left behind.

Adapters and weights go to a server on this host as files: peft's format (or one safetensors file of
weights) in a directory of Orbit's own in /dev/shm (memory, not disk), one directory per load, read
by the server (`/load_lora_adapter`, `/update_weights_from_disk`) and deleted once nothing uses it;
the whole directory goes when the engine closes, and one left by an Orbit that was killed is removed
by the next (its process is gone). No pickle, no shared-memory handles, nothing for the server to
keep, and no helper process (torch's `torch_shm_manager`, which a shared-memory hand-off starts,
would outlive Orbit holding its output streams).

SGLang's own leftovers are listed here too, for whoever stops its processes to remove: each
scheduler's load-snapshot file in /dev/shm, and the socket files of an in-process engine.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from orbit.host.scratch import own_dir

SHM = Path("/dev/shm")
PREFIX = "orbit-adapters-"


def adapter_root() -> Path:
    """A fresh directory of this process's for adapter files (in /dev/shm where it can be written);
    the directories of Orbit processes that are gone are removed first."""
    base = SHM if SHM.is_dir() and os.access(SHM, os.W_OK) else Path(tempfile.gettempdir())
    return own_dir(PREFIX, base)


# What SGLang's processes leave in /dev/shm when they are killed: each scheduler's load-snapshot
# file (never removed, even at a clean exit) and multiprocessing's named semaphores (their
# resource tracker unlinks them at its exit, unless it is killed with the rest)
SGLANG_SHM = ("sglang_", "sem.mp-")


def sglang_shm_files(pids: list[int]) -> list[Path]:
    """The /dev/shm entries SGLang's processes `pids` hold, open (the load snapshot,
    `sglang_loads_*.shm`) or mapped (the semaphores, `sem.mp-*`, which a process maps under the
    temporary name it made them by: they are found by inode): to be removed once those processes
    are gone."""
    import psutil

    paths: set[str] = set()
    inodes: set[int] = set()
    for pid in pids:
        try:
            paths |= {f.path for f in psutil.Process(pid).open_files()}
            maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except (psutil.Error, OSError):
            continue
        for line in maps:  # address perms offset dev inode path
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(f"{SHM}/"):
                inodes.add(int(fields[4]))
    found = []
    for entry in SHM.iterdir() if SHM.is_dir() else []:
        if not entry.name.startswith(SGLANG_SHM):
            continue
        try:
            mine = str(entry) in paths or entry.stat().st_ino in inodes
        except OSError:
            continue  # gone meanwhile
        if mine:
            found.append(entry)
    return sorted(found)


def start_files(port_args: object) -> list[Path]:
    """What an in-process engine's start makes in /dev/shm and the temporary directory, found from
    its ports (a start that failed has no processes left to ask): the scheduler's load-snapshot
    file and the ZeroMQ socket files."""
    from sglang.srt.managers.load_snapshot import shm_path_for

    return [Path(shm_path_for(port_args.instance_id)), *ipc_files(port_args)]  # type: ignore[attr-defined]


def ipc_files(port_args: object) -> list[Path]:
    """The socket files of an in-process engine's ZeroMQ channels (`ipc://` names SGLang makes with
    NamedTemporaryFile(delete=False) and never removes)."""
    names = [v for v in vars(port_args).values() if isinstance(v, str) and v.startswith("ipc://")]
    return [Path(name[len("ipc://") :]) for name in names]


def remove(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)
