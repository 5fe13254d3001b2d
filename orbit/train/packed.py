"""A sweep's runs whose batches are ready together take their steps in one forward/backward over the
shared base (packing.py): the base's matmuls once for all of their tokens, each adapter on its own
rows, each run's loss with its own normalisation, temperature and algorithm, each gradient in its
own adapter, each optimizer step its own. A run's step is what it is alone (tests/test_packing.py).

`StepPacker.step` is what a run's `Trainer.step` calls (instead of taking a turn of the base): the
first run to find the base free takes every step waiting, its own among them, and runs them as one
pack; the others wait for their results. Runs that arrive while a pack runs form the next pack, so
none waits behind more than one. A step that a pack cannot carry (several optimizer steps a batch, a
KL reference, several ranks: `packable`) runs alone, in a turn of its own.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from orbit.rollout.sample import Sample
from orbit.train.batch import join, output_hidden, padded_tokens
from orbit.train.measure import StepResult, Totals
from orbit.train.packing import Route
from orbit.train.shared import SharedBase

if TYPE_CHECKING:
    from orbit.rl import Norm
    from orbit.train.trainer import Trainer


def packable(trainer: Trainer) -> bool:
    """Whether the trainer's step can share a pass: one optimizer step a batch (no proximal pass,
    no mini-batches), no KL reference (a pass of the bare base of its own), one rank."""
    algo = trainer.algo
    return algo.optimizer_steps == 1 and algo.kl_coef == 0 and trainer.ranks.world == 1


@dataclass
class _Job:
    trainer: Trainer
    samples: list[Sample]
    future: Future = field(default_factory=Future)
    asked: float = field(default_factory=time.perf_counter)
    started: float = 0.0  # when its pack (or its turn) began


@dataclass
class _Run:
    """One trainer's step in a pack, under way."""

    job: _Job
    norm: Norm
    lr: float
    chunks: list[tuple[list[Sample], bool]]
    step: Totals = field(default_factory=Totals)


class StepPacker:
    """The base's steps, packed (the module's docstring)."""

    def __init__(self, shared: SharedBase) -> None:
        self.shared = shared
        self.packs: list[int] = []  # the runs in each pack, for the bench
        self._cond = threading.Condition()
        self._waiting: list[_Job] = []
        self._busy = False

    def step(self, trainer: Trainer, samples: list[Sample]) -> StepResult:
        """`trainer`'s step on `samples`, in a pack with the other runs' steps waiting when the
        base is next free."""
        job = _Job(trainer, samples)
        with self._cond:
            self._waiting.append(job)
        while True:
            with self._cond:
                if job.future.done():
                    return self._result(job)
                if self._busy:  # another run's thread runs the pack we are in, or the one before
                    self._cond.wait(1.0)
                    continue
                self._busy = True
            try:
                # every step waiting once the base is ours (a turn of another user of the base,
                # merged weights for a push, may hold it a while: more steps wait meanwhile)
                with self.shared.held():
                    with self._cond:
                        jobs, self._waiting = self._waiting, []
                    if jobs:
                        self._run(jobs)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def waiting(self) -> int:
        """Steps asked for and not yet taken into a pack."""
        with self._cond:
            return len(self._waiting)

    @staticmethod
    def _result(job: _Job) -> StepResult:
        result = job.future.result()  # the run's own failure, raised in its own thread
        result.queue_s = job.started - job.asked  # waiting for the base: other runs' steps
        return result

    def _run(self, jobs: list[_Job]) -> None:
        self.packs.append(len(jobs))
        together = [j for j in jobs if packable(j.trainer)]
        alone = [j for j in jobs if not packable(j.trainer)]
        if len(together) == 1:
            alone, together = together + alone, []
        for job in alone:
            _own(job)
        if together:
            _pack(self.shared, together)


def _own(job: _Job) -> None:
    """The step in a pass of its own (peft's forward, as a run alone), the base held."""
    job.started = time.perf_counter()
    try:
        job.trainer.shared.use(job.trainer.name)
        job.future.set_result(job.trainer._step(job.samples))
    except BaseException as err:  # noqa: BLE001 - the run's own failure, raised in its thread
        job.future.set_exception(err)


def _pack(shared: SharedBase, jobs: list[_Job]) -> None:
    """One optimizer step for each job's trainer, their forwards and backwards in shared passes
    (the base held: StepPacker.step)."""
    router = shared.routed([j.trainer.name for j in jobs])
    first = jobs[0].trainer
    runs = []
    for job in jobs:
        job.started = time.perf_counter()
        t = job.trainer
        t._flops = 0.0
        lr = t.optimizer.param_groups[0]["lr"]
        runs.append(_Run(job, t._start_step(job.samples), lr, t._micro_batches(job.samples)))
    try:
        for part in _passes(runs, first.cfg.micro_batch_tokens):
            _forward_backward(first, part, router)
    except BaseException as err:  # noqa: BLE001 - the pass failed: every step in it did
        for run in runs:
            run.job.future.set_exception(err)
        return
    for run in runs:
        t = run.job.trainer
        shared.use(t.name)  # its re-score, if it takes one, runs peft's forward for it alone
        try:
            totals = Totals()
            norm = t._end_step(run.job.samples, run.step, totals, measure=True)
            result = t._finish(totals, [norm], len(run.job.samples), run.lr)
            result.packed = len(runs)
            run.job.future.set_result(result)
        except BaseException as err:  # noqa: BLE001 - its own (a non-finite gradient)
            run.job.future.set_exception(err)


def _passes(runs: list[_Run], budget: int) -> list[list[tuple[_Run, list[Sample], bool]]]:
    """The runs' micro-batches in passes of at most `budget` padded tokens (0: one pass), each
    run's in its order: as many runs' next micro-batches as fit, round by round."""
    queue = [(r, chunk, counts) for i in range(max(len(r.chunks) for r in runs)) for r in runs
             if i < len(r.chunks) for chunk, counts in [r.chunks[i]]]  # fmt: skip
    out: list[list[tuple[_Run, list[Sample], bool]]] = []
    size = 0
    for item in queue:
        cost = padded_tokens(item[1])
        if not out or (budget > 0 and size + cost > budget):
            out.append([])
            size = 0
        out[-1].append(item)
        size += cost
    return out


def _forward_backward(first: Trainer, part: list[tuple[_Run, list[Sample], bool]], router) -> None:
    """One pass over the base for the micro-batches of `part` (several runs'), each run's loss on
    its own rows, one backward for all of them."""
    batches = [run.job.trainer._collate(chunk) for run, chunk, _ in part]
    joined = join(batches, first.pad_id)
    names = [run.job.trainer.name for (run, _, _), b in zip(part, batches, strict=True)
             for _ in range(b.prompt_ids.shape[0])]  # fmt: skip
    if first.cores is not None:
        first.cores.apply()
    hidden = output_hidden(
        first._decoder, joined, first.buckets, first.bucket_cost, Route(router, names)
    )
    loss = hidden.new_zeros(())
    row = 0
    for (run, chunk, counts), batch in zip(part, batches, strict=True):
        t = run.job.trainer
        t._count_flops(batch)
        n, width = batch.output_ids.shape
        mine = hidden[row : row + n, :width]
        row += n
        logp, entropy = t._project(mine, batch, entropy_grad=t.algo.entropy_coef > 0)
        loss = loss + t._chunk_loss(
            chunk, counts, batch, logp, entropy, run.norm, None, run.step, True
        )
    if loss.requires_grad:
        loss.backward()
