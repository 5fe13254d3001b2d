"""`python slow_serve.py SLOW ARGS...`: `orbit ARGS...` (an `orbit serve`) with one piece slowed, so
that tests/test_serve_service.py can kill -9 the service in the middle of it. SLOW is `optim` (a
client's third optim_step, before it applies) or `save` (a checkpoint written over one of the same
name, its files in the temporary directory, before the rename), or `none`. The piece prints a line
when it starts and sleeps; nothing else changes."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from orbit.cli import app
from orbit.host import files
from orbit.serve import clients

SLEEP_S = 60.0


def slow_optim_steps() -> None:
    step = clients.TrainingClient.optim_step

    def slowed(self, adam):
        if self.steps == 2:
            print("OPTIM_STEP_RUNNING", flush=True)
            time.sleep(SLEEP_S)
        return step(self, adam)

    clients.TrainingClient.optim_step = slowed


def slow_overwrites() -> None:
    fsync = files.fsync

    def slowed(path: Path) -> None:
        tmp = path.parent
        over = tmp.name.startswith(".") and tmp.name.endswith(".tmp")
        if over and (tmp.parent / tmp.name[1:].rsplit(".", 2)[0]).exists():
            print("SAVE_RUNNING", flush=True)
            time.sleep(SLEEP_S)
        fsync(path)

    files.fsync = slowed


if __name__ == "__main__":
    slow, args = sys.argv[1], sys.argv[2:]
    {"optim": slow_optim_steps, "save": slow_overwrites, "none": lambda: None}[slow]()
    app(args)
