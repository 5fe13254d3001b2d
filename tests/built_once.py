"""What the tests build once and keep in .cache (tiny models, their chat-template copies), built by
one test process at a time: `make test` runs two at a time (pytest-xdist), and two builds of one
directory at once would leave a reader half a checkpoint."""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def building(path: Path) -> Iterator[None]:
    """Held while `path` is checked and built; another process building it waits here."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
