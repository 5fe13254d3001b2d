"""What reaches an SGLang server on this host, and how nothing of it is left behind.

Adapters go as files: peft's format in a directory of Orbit's own in /dev/shm (memory, not disk), one
directory per load, loaded by the server with `/load_lora_adapter` and deleted once no slot holds it;
the whole directory goes when the engine closes, and one left by an Orbit that was killed is removed by
the next (its process is gone). No pickle, no shared-memory handles, nothing for the server to keep.

Full weights go as shared memory (`/update_weights_from_tensor` takes nothing else): torch's
`file_system` strategy puts each tensor in a named segment that the server maps. Two things torch
would leave behind are dealt with here:
- the segments: their names are removed as soon as the server has answered (the mappings stay valid
  while either side uses them), so pushes do not pile up in /dev/shm;
- torch's `torch_shm_manager`, a helper process torch starts on first use, which would inherit this
  process's stdout and stderr and, kept alive by the server's connection, hold them open after Orbit
  exits (a pipe into `tee` would never end): it is started once with /dev/null for all three.
"""

from __future__ import annotations

import base64
import io
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import torch

_SHARING_LOCK = threading.Lock()  # the sharing strategy is process-wide; one updater thread per server
_manager_started = False
SHM = Path("/dev/shm")
PREFIX = "orbit-adapters-"


def adapter_root() -> Path:
    """A fresh directory of this process's for adapter files (in /dev/shm where it can be written); the
    directories of Orbit processes that are gone are removed first."""
    base = SHM if SHM.is_dir() and os.access(SHM, os.W_OK) else Path(tempfile.gettempdir())
    for old in base.glob(f"{PREFIX}*"):
        pid = old.name[len(PREFIX):].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=base))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def share(named: list[tuple[str, torch.Tensor]]) -> tuple[str, list[Path]]:
    """What SGLang's `MultiprocessingSerializer.serialize(named, output_str=True)` makes, with torch's
    `file_system` strategy (named segments any process on this host can map; the default, file
    descriptors, goes through this process's resource sharer, which refuses a server Orbit did not
    spawn), and the segments it created: `release` them once the server has answered."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as shared  # registers torch's reductions with ForkingPickler

    with _SHARING_LOCK:
        previous = shared.get_sharing_strategy()
        shared.set_sharing_strategy("file_system")
        try:
            _start_manager_quietly()
            buf = io.BytesIO()
            ForkingPickler(buf).dump(named)
            segments = [_segment(t) for _, t in named]
        finally:
            shared.set_sharing_strategy(previous)
    return base64.b64encode(buf.getvalue()).decode(), segments


def release(segments: list[Path]) -> None:
    for path in segments:
        path.unlink(missing_ok=True)


def _segment(t: torch.Tensor) -> Path:
    """The /dev/shm name of a tensor shared with the file_system strategy (sharing it again is a no-op)."""
    _, handle, _ = t.untyped_storage()._share_filename_cpu_()
    return SHM / handle.decode().lstrip("/")


def _start_manager_quietly() -> None:
    """Start torch's shm manager now, with /dev/null as its stdin, stdout and stderr (it inherits them)."""
    global _manager_started
    if _manager_started:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(fd) for fd in (0, 1, 2)]
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        probe = torch.empty(1).share_memory_()  # the first file_system share starts the manager
    finally:
        for fd, copy in zip((0, 1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)
        os.close(null)
    release([_segment(probe)])
    _manager_started = True
