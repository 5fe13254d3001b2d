"""`python slow_serve.py SLOW ARGS...`: `orbit ARGS...` (an `orbit serve`) with one piece slowed, so
that tests/test_serve_service.py can kill -9 the service in the middle of it. SLOW is `optim` (a
client's third optim_step, before it applies) or `save` (a checkpoint written over one of the same
name, its files in the temporary directory, before the rename), or `none`. The piece prints a line
when it starts and sleeps, then `POLLED` once the SDK has asked how that request ended: only then
does the SDK hold the request's id (killed before, it would send the request again to the restarted
service instead). Nothing else changes."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from orbit.cli import app
from orbit.host import files
from orbit.serve import clients, futures

SLEEP_S = 60.0
LOCK = threading.Lock()
POLLED: list[futures.Record] = []  # the requests the SDK has asked about
SLEEPING: list[str] = []  # the kind of the request that sleeps now, until its poll is seen


def say_when_polled() -> None:
    get = futures.Futures.get

    def watching(self, request_id, owner):
        found = get(self, request_id, owner)
        if isinstance(found, futures.Record):
            with LOCK:
                POLLED.append(found)
                _say()
        return found

    futures.Futures.get = watching


def _say() -> None:
    """Under LOCK: POLLED, once, when the sleeping request has been asked about (the SDK waits for
    each request before it sends the next of its kind, so a polled one not done is this one)."""
    if SLEEPING and any(r.kind == SLEEPING[0] and not r.future.done() for r in POLLED):
        SLEEPING.clear()
        print("POLLED", flush=True)


def sleep(line: str, kind: str) -> None:
    print(line, flush=True)
    with LOCK:
        SLEEPING[:] = [kind]
        _say()
    time.sleep(SLEEP_S)


def slow_optim_steps() -> None:
    step = clients.TrainingClient.optim_step

    def slowed(self, adam):
        if self.steps == 2:
            sleep("OPTIM_STEP_RUNNING", "OptimStep")
        return step(self, adam)

    clients.TrainingClient.optim_step = slowed


def slow_overwrites() -> None:
    fsync = files.fsync

    def slowed(path: Path) -> None:
        tmp = path.parent
        over = tmp.name.startswith(".") and tmp.name.endswith(".tmp")
        if over and (tmp.parent / tmp.name[1:].rsplit(".", 2)[0]).exists():
            sleep("SAVE_RUNNING", "SaveWeights")
        fsync(path)

    files.fsync = slowed


if __name__ == "__main__":
    slow, args = sys.argv[1], sys.argv[2:]
    say_when_polled()
    {"optim": slow_optim_steps, "save": slow_overwrites, "none": lambda: None}[slow]()
    app(args)
