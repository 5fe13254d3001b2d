"""Trainer ranks: one trainer process per device, started by torch's launcher
(`torch.distributed.run`, the code behind `torchrun`), NCCL between GPUs and gloo on CPU.

Rank 0 is the run: engines, producer, pool, push, metrics, checkpoints and the console. The other
ranks only train. Each step rank 0 sends every rank the whole batch (`send`, a broadcast on a gloo
group of its own), each rank trains on its share (`split_by_tokens`: by tokens, so that the ranks
finish together), and the adapter's gradients are summed over the ranks in one all-reduce of one
flat buffer (what DDP does; for an adapter this is one small collective a step). Every rank then
steps the same optimizer on the same gradients, so the adapter and its optimizer state stay
replicated: rank 0 alone holds all that a push or a checkpoint needs, also after another rank is
lost, and a checkpoint is the one a single rank writes (resume with any number of ranks).

`trainer.shard: fsdp` shards the frozen base over the ranks with FSDP2's `fully_shard` (each decoder
layer, then the decoder), the adapter's parameters left out (`ignored_params`): the base is what
does not fit on one device, and leaving the adapter whole keeps the rest of this module as it is.
Every forward of a sharded module is a collective, so under FSDP every rank runs as many
micro-batches as the busiest one (`padded_micro_batches`).

Liveness. Each rank counts a heartbeat in the launcher's store once a second and watches the others'
(rank 0 all of them, the others rank 0). A rank whose count stands still for
`trainer.rank_timeout_s` is lost: another rank exits at once, saying which; rank 0 is interrupted
(`on_lost`) and saves the adapter of its last complete step. Collectives of a step time out after
`rank_timeout_s` too, so no rank waits in one for ever; the command broadcast has no such bound
(rank 0 may wait long for rollouts), the heartbeat is its bound.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor

from orbit.rollout.sample import Sample
from orbit.train.batch import micro_batches, prompt_groups
from orbit.train.launcher import RankInfo

BEAT_S = 1.0
LAUNCHER_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
_COMMAND_TIMEOUT = timedelta(days=30)  # rank 0 may wait long between steps; the heartbeat bounds it


class RankLost(RuntimeError):
    """Another rank died or stopped answering; the message names it and its host."""


def split_by_tokens(samples: list[Sample], world: int) -> list[list[Sample]]:
    """Each rank's share of a batch: whole prompt groups (a prompt runs once per rank that has its
    samples) given largest first to the rank with the fewest tokens so far; single samples when
    there are fewer groups than ranks. Deterministic: every rank computes every share alike."""
    groups = list(prompt_groups(samples).values())
    units = groups if len(groups) >= world else [[s] for s in samples]
    shares: list[list[Sample]] = [[] for _ in range(world)]
    tokens = [0] * world

    def cost(unit: list[Sample]) -> int:
        return len(unit[0].prompt_ids) + sum(len(s.output_ids) for s in unit)

    for unit in sorted(units, key=cost, reverse=True):
        rank = min(range(world), key=lambda r: (tokens[r], r))
        shares[rank] += unit
        tokens[rank] += cost(unit)
    return shares


def padded_micro_batches(
    samples: list[Sample], world: int, rank: int, budget: int, pad: bool
) -> list[tuple[list[Sample], bool]]:
    """This rank's micro-batches of the batch, each with whether it counts; `pad`: as many as the
    busiest rank has, the extra ones a real sample whose loss is multiplied by 0 (sharded modules
    all-gather in every forward, so every rank must run as many)."""
    shares = split_by_tokens(samples, world)
    mine = [(chunk, True) for chunk in micro_batches(shares[rank], budget)]
    if pad:
        most = max(len(micro_batches(share, budget)) for share in shares)
        mine += [(samples[:1], False)] * (most - len(mine))
    return mine


class Alone:
    """A trainer with no other rank: what the trainer asks of its ranks, with no one to tell. The
    trainer is given this or `Ranks`, so a single run, a sweep's run and a rank run one code
    path."""

    world, rank, leader, lost = 1, 0, True, None

    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device)

    def send(self, what: str, payload: object = None) -> None:
        pass

    def share(
        self, samples: list[Sample], budget: int, pad: bool
    ) -> list[tuple[list[Sample], bool]]:  # noqa: ARG002
        return [(chunk, True) for chunk in micro_batches(samples, budget)]

    def sum_grads(self, params: Sequence[Tensor]) -> None:
        pass

    def all_reduce(self, tensor: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        pass

    def broadcast_params(self, params: Sequence[Tensor]) -> None:
        pass

    def shard_base(self, decoder: torch.nn.Module, keep: Sequence[torch.nn.Parameter]) -> None:
        raise ValueError(
            "trainer.shard: fsdp shards the base over several ranks; this trainer is alone"
        )


class Ranks:
    """This process's place among the trainer ranks, the collectives a step needs, and the
    heartbeat."""

    def __init__(self, info: RankInfo, devices: list[str], timeout_s: float) -> None:
        if info.local_world != len(devices):
            from orbit.config import RecipeError

            raise RecipeError(
                f"trainer.devices: {len(devices)} device(s) {devices}, but {info.local_world} "
                "ranks were started on this host; start one rank per device (torchrun "
                f"--nproc-per-node {len(devices)})"
            )
        self.rank, self.world = info.rank, info.world
        self.device = torch.device(devices[info.local_rank])
        self.timeout_s = timeout_s
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            timeout=timedelta(seconds=timeout_s),
            device_id=self.device if self.device.type == "cuda" else None,
        )
        self._commands = dist.new_group(backend="gloo", timeout=_COMMAND_TIMEOUT)
        self.hosts: list[str] = [""] * self.world
        dist.all_gather_object(self.hosts, socket.gethostname(), group=self._commands)
        self.lost: str | None = None  # why another rank counts as lost, once it does
        # rank 0: how the run is told (set by the run)
        self.on_lost: Callable[[], None] | None = None
        self._stopped = threading.Event()
        self._store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=timeout_s),
        )
        self._prefix = f"orbit/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/beat/"
        self._watch = threading.Thread(target=self._heartbeat, name="orbit-ranks", daemon=True)
        self._watch.start()
        # What the launcher told this rank is read: engines and servers started from here must not
        # take it for theirs (SGLang's schedulers read RANK, LOCAL_RANK, MASTER_PORT ... and then
        # hang).
        for key in [k for k in os.environ if k in LAUNCHER_ENV or k.startswith("TORCHELASTIC_")]:
            # where an error of this rank is reported to the launcher
            if key != "TORCHELASTIC_ERROR_FILE":
                del os.environ[key]

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def where(self, rank: int) -> str:
        return f"rank {rank} on {self.hosts[rank]}"

    # -- what rank 0 says, the others do ------------------------------------------------------

    def send(self, what: str, payload: object = None) -> None:
        """Rank 0: tell every rank what to do next (and with what)."""
        self.check()
        if what == "stop":
            self._stopped.set()  # the others leave now: their heartbeats stopping is no loss
        try:
            dist.broadcast_object_list([what, payload], src=0, group=self._commands)
        except (RuntimeError, ValueError) as err:
            raise self._lost_error(err) from err

    def receive(self) -> tuple[str, object]:
        """Every other rank: what rank 0 says to do next."""
        message: list = [None, None]
        dist.broadcast_object_list(message, src=0, group=self._commands)
        return message[0], message[1]

    # -- the collectives of a step --------------------------------------------------------------

    def share(
        self, samples: list[Sample], budget: int, pad: bool
    ) -> list[tuple[list[Sample], bool]]:
        """This rank's micro-batches of the batch, each with whether it counts
        (`padded_micro_batches`)."""
        return padded_micro_batches(samples, self.world, self.rank, budget, pad)

    def sum_grads(self, params: Sequence[Tensor]) -> None:
        """Sum the adapter's gradients over the ranks, in one flat buffer (a rank with nothing to
        train has zeros). Not DDP's reducer: DDP wraps the module and reduces buckets during a
        backward that every rank runs alike; here ranks run different numbers of micro-batches and
        only the adapter's few tensors need one sum."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.all_reduce(flat)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n

    def all_reduce(self, tensor: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        """In place, on this rank's device (NCCL reduces GPU tensors only)."""
        on_device = tensor.to(self.device)
        try:
            dist.all_reduce(on_device, op=op)
        except (RuntimeError, ValueError) as err:
            raise self._lost_error(err) from err
        if on_device is not tensor:
            tensor.copy_(on_device)

    def broadcast_params(self, params: Sequence[Tensor]) -> None:
        """Rank 0's values on every rank (one adapter init, whatever each rank's random state)."""
        for p in params:
            dist.broadcast(p.data, src=0)

    def shard_base(self, decoder: torch.nn.Module, keep: Sequence[torch.nn.Parameter]) -> None:
        """FSDP2 over the frozen base: each decoder layer, then the decoder (its embedding and final
        norm); `keep` (the adapter) stays whole on every rank."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(self.device.type, (self.world,))
        ignored = set(keep)
        for layer in cast(torch.nn.ModuleList, decoder.layers):
            fully_shard(layer, mesh=mesh, ignored_params=ignored)
        fully_shard(decoder, mesh=mesh, ignored_params=ignored)

    # -- liveness ---------------------------------------------------------------------------------

    def check(self) -> None:
        if self.lost is not None:
            raise RankLost(self.lost)

    def _lost_error(self, err: BaseException) -> RankLost:
        """A collective failed: the rank to blame is one whose heartbeat stands still over a few
        beats (a dead rank fails a collective at once; a hung one only at the collective's
        timeout)."""
        if self.lost is None:
            silent = self._silent(3 * BEAT_S)
            if silent:
                self.lost = f"{self.where(silent[0])} stopped answering (it died or hangs)"
        return RankLost(
            self.lost or f"a collective with the other ranks failed ({str(err).splitlines()[0]})"
        )

    def _silent(self, seconds: float) -> list[int]:
        """The other ranks whose heartbeat does not move for `seconds`."""
        store = dist.TCPStore(
            self._store.host, self._store.port, is_master=False, timeout=timedelta(seconds=5)
        )
        others = [r for r in range(self.world) if r != self.rank]
        try:
            before = {r: store.add(f"{self._prefix}{r}", 0) for r in others}
            time.sleep(seconds)
            return [r for r in others if store.add(f"{self._prefix}{r}", 0) == before[r]]
        except Exception:  # noqa: BLE001 - the store itself is gone: no one to name
            return []

    def _heartbeat(self) -> None:
        # Not `monitored_barrier`: every rank must enter it, and rank 0 spends most of its time
        # outside any collective (waiting for rollouts); nor the elastic agent's monitoring, which
        # sees a worker exit but not one that hangs. A count in the launcher's store shows both,
        # wherever the other rank is.
        watched = range(1, self.world) if self.leader else [0]
        seen = {r: (-1, time.monotonic()) for r in watched}
        while not self._stopped.wait(BEAT_S):
            try:
                self._store.add(f"{self._prefix}{self.rank}", 1)
                counts = {r: self._store.add(f"{self._prefix}{r}", 0) for r in watched}
            # the launcher's store is gone: so is the launcher
            except Exception as err:  # noqa: BLE001
                self._lose(f"the launcher's store stopped answering ({str(err).splitlines()[0]})")
                return
            now = time.monotonic()
            for r, count in counts.items():
                if count != seen[r][0]:
                    seen[r] = (count, now)
                elif now - seen[r][1] > self.timeout_s:
                    self._lose(
                        f"{self.where(r)} stopped answering (no heartbeat for "
                        f"{now - seen[r][1]:.0f} s, trainer.rank_timeout_s {self.timeout_s:g})"
                    )
                    return

    def _lose(self, why: str) -> None:
        self.lost = why
        if not self.leader:  # nothing to save here: rank 0 holds the adapter
            sys.stderr.write(f"orbit {self.where(self.rank)}: {why}; this rank stops\n")
            sys.stderr.flush()
            os._exit(1)
        if self.on_lost is not None:
            self.on_lost()

    def close(self) -> None:
        """Rank 0: tell the others to stop (when they can still hear it); every rank: leave the
        group."""
        if self.leader and self.lost is None:
            try:
                self.send("stop")
            except RankLost:
                pass
        self._stopped.set()
        if threading.current_thread() is not self._watch:
            # No store call in flight when the process exits: C++ aborts on a store thread torn down
            # mid-call.
            self._watch.join(timeout=self.timeout_s)
        # Taking the group down waits on every rank; a hung one would hold this rank for ever.
        # Bounded.
        down = threading.Thread(target=_destroy_group, name="orbit-ranks-down", daemon=True)
        down.start()
        down.join(timeout=self.timeout_s if self.lost is None else 2 * BEAT_S)


def _destroy_group() -> None:
    try:
        dist.destroy_process_group()
    # a group with a lost rank may not come down cleanly; we exit anyway
    except Exception:  # noqa: BLE001
        pass
