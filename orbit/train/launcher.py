"""`orbit train` with `trainer.devices` of several devices: start one trainer rank per device
through torch's own launcher (`torch.distributed.run`'s elastic agent, the code behind `torchrun`),
each rank running this same command, and say in one line how they ended.

The agent starts every rank in a session of its own and forwards a Ctrl-C to them (rank 0 finishes
its step and saves; the others follow it until it says stop). When a rank fails, the agent stops the
others with SIGTERM, which rank 0 takes as Ctrl-C: it saves the adapter of its last complete step.
Several hosts: run `torchrun --nnodes ... -m orbit.cli train RECIPE` on each yourself (README).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import uuid
from dataclasses import dataclass

# Seconds the agent waits for the ranks after forwarding Ctrl-C or stopping them, before it kills
# them.
SHUTDOWN_S = 120


@dataclass
class RanksEnded:
    code: int  # the command's exit code: rank 0's, or 1 when another rank failed
    line: str | None  # what to say (None: rank 0 said it all)


@dataclass
class RankInfo:
    rank: int
    world: int
    local_rank: int
    local_world: int


def launched() -> RankInfo | None:
    """The rank this process is, when a launcher (torchrun, or `orbit train` with several devices)
    started it; None when no launcher did."""
    if "LOCAL_RANK" not in os.environ:
        return None
    world = int(os.environ["WORLD_SIZE"])
    return RankInfo(
        int(os.environ["RANK"]),
        world,
        int(os.environ["LOCAL_RANK"]),
        int(os.environ.get("LOCAL_WORLD_SIZE", world)),
    )


def launch_ranks(n: int, args: list[str]) -> RanksEnded:
    """Run `python -m orbit.cli ARGS` as `n` ranks on this host; returns how they ended."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    # Orbit says it in one line
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        elastic_launch(_local_ranks(n, f"orbit-{uuid.uuid4().hex[:8]}"), entrypoint=sys.executable)(
            "-m", "orbit.cli", *args
        )
    except ChildFailedError as err:
        return _failed(err)
    # Ctrl-C or a kill of this launcher: forwarded to the ranks, which stopped
    except SignalException as err:
        return RanksEnded(128 + err.sigval, None)
    return RanksEnded(0, None)


def call_on_ranks(n: int, fn, *args, run_id: str):
    """`fn(*args)` as `n` ranks on this host (a function, for tests and benches); rank 0's return
    value."""
    from torch.distributed.launcher.api import elastic_launch

    return elastic_launch(_local_ranks(n, run_id), fn)(*args)[0]


def _local_ranks(n: int, run_id: str):
    """The launcher's settings for `n` ranks on this host, meeting on a free loopback port."""
    from torch.distributed.launcher.api import LaunchConfig

    from orbit.host.net import free_port

    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=n,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=0,
        monitor_interval=0.5,
        shutdown_timeout=SHUTDOWN_S,
    )


def _failed(err) -> RanksEnded:
    """Rank 0 ending with an error said what it was and what it saved; another rank failing is said
    here (rank 0 has said what it saved)."""
    failures = err.failures
    if 0 in failures and len(failures) == 1 and failures[0].exitcode > 0:
        return RanksEnded(failures[0].exitcode, None)
    others = {r: f for r, f in failures.items() if r != 0} or failures
    rank, failure = min(others.items())
    how = (
        f"was killed by {signal.Signals(-failure.exitcode).name}"
        if failure.exitcode < 0
        else f"exited with code {failure.exitcode}"
    )
    return RanksEnded(1, f"trainer rank {rank} on {socket.gethostname()} {how}; the run stopped")
