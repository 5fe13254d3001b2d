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


def sglang_shm_files(pids: list[int]) -> list[Path]:
    """The /dev/shm files SGLang's processes `pids` hold open (each scheduler's load snapshot,
    `sglang_loads_*.shm`, which SGLang never removes): to be removed once those processes are
    gone."""
    import psutil

    found = []
    for pid in pids:
        try:
            found += [
                Path(f.path)
                for f in psutil.Process(pid).open_files()
                if f.path.startswith(f"{SHM}/sglang_")
            ]
        except psutil.Error:
            pass
    return found


def ipc_files(port_args: object) -> list[Path]:
    """The socket files of an in-process engine's ZeroMQ channels (`ipc://` names SGLang makes with
    NamedTemporaryFile(delete=False) and never removes)."""
    names = [v for v in vars(port_args).values() if isinstance(v, str) and v.startswith("ipc://")]
    return [Path(name[len("ipc://") :]) for name in names]


def remove(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)
