"""The rollout producer: a background thread that keeps the engine fed with whole groups.

One producer serves both loop kinds; they differ only in when groups are granted:
- serial: the loop grants one batch of groups per step, then waits for all of them (a barrier);
  nothing is generated while the trainer trains.
- overlapped: the whole run's groups are granted at start; the producer keeps up to
  `max_inflight` requests in flight all the time and the trainer takes groups as they complete.
  Each group dropped as stale grants one more (replenish), so the pipeline never drains.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

from orbit.engine.base import ACTIVE, Completion, Engine, SamplingParams
from orbit.metrics import Timeline
from orbit.rollout.buffer import GroupBuffer
from orbit.rollout.episode import Episode, continue_episode, with_task_stops
from orbit.rollout.groups import build_group
from orbit.tasks.base import Prompt, Task, TaskError, is_multi_turn


@dataclass
class _Pending:
    prompt: Prompt
    completions: list[Completion | Episode | None]
    attempts: list[int] = field(default_factory=list)
    episodes: list[Episode] | None = None  # multi-turn tasks: each sample's episode in progress


def max_ahead_groups(prompts_per_step: int, max_staleness: int | None) -> int:
    """How many groups may be in flight or buffered so that none is older than `max_staleness`
    when trained: (K + 1) batches; two batches (one-step-off) when staleness is unbounded."""
    return prompts_per_step * (2 if max_staleness is None else max_staleness + 1)


class Producer:
    def __init__(
        self,
        engine: Engine,
        task: Task,
        sampling: SamplingParams,
        group_size: int,
        buffer: GroupBuffer,
        max_inflight: int,
        max_ahead: int,
        seed: int,
        timeline: Timeline | None = None,
    ) -> None:
        self.engine = engine
        self.task = task
        self.sampling = with_task_stops(sampling, task)  # + the task's own (a tool call's end)
        self.multi_turn = is_multi_turn(task)
        self.max_context: int | None = getattr(getattr(engine, "info", None), "max_context", None)
        self.group_size = group_size
        self.buffer = buffer
        self.max_inflight = max_inflight
        self.max_ahead = max_ahead  # run-ahead bound: groups in flight or waiting for the trainer
        self.seed = seed
        self.timeline = timeline
        self._prompts = task.prompts(seed)
        self._events: queue.Queue = queue.Queue()
        self._pending: dict[int, _Pending] = {}
        self._inflight = 0
        self._granted = 0
        self._lock = threading.Lock()  # guards _granted (grant() is called from other threads)
        self._next_group = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="orbit-producer", daemon=True)
        self.resubmitted = 0  # samples resubmitted after the engine aborted them

    # ---- control, from the trainer thread -------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def grant(self, n_groups: int) -> None:
        """Allow `n_groups` more groups to be submitted."""
        with self._lock:
            self._granted += n_groups
        self._events.put(None)  # wake the thread

    def wake(self) -> None:
        """Re-check whether more groups may be submitted (the buffer made room)."""
        self._events.put(None)

    def stop(self) -> None:
        self._stop.set()
        self._events.put(None)
        self._thread.join(timeout=10)

    # ---- the producer thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._fill()
                event = self._events.get()
                if event is not None:
                    self._on_done(*event)
        except BaseException as err:  # noqa: BLE001 - any failure must reach the trainer
            self.buffer.fail(err)

    def _fill(self) -> None:
        while not self._stop.is_set() and self._take_grant():
            self._submit_group(self._next_prompt())

    def _take_grant(self) -> bool:
        room = self._inflight + self.group_size <= self.max_inflight
        # Run-ahead bound: a group with A groups ahead of it is trained about A / batch steps later,
        # so more than that would only go stale (see `max_ahead_groups`).
        ahead = len(self.buffer) + len(self._pending) < self.max_ahead
        with self._lock:
            if self._granted > 0 and room and ahead:
                self._granted -= 1
                return True
        return False

    def _next_prompt(self) -> Prompt:
        try:
            return next(self._prompts)
        except StopIteration:
            raise TaskError(f"task {self.task.name!r}: prompts() ran out; a task's prompt stream must be "
                            "endless (cycle through a dataset)") from None
        except Exception as err:  # noqa: BLE001 - a failing task stops the run, named
            raise TaskError(f"task {self.task.name!r}: prompts() failed: {type(err).__name__}: {err}") from err

    def _submit_group(self, prompt: Prompt) -> None:
        gid = self._next_group
        self._next_group += 1
        episodes = [Episode(list(prompt.prompt_ids)) for _ in range(self.group_size)] if self.multi_turn else None
        self._pending[gid] = _Pending(prompt, [None] * self.group_size, [0] * self.group_size, episodes)
        for idx in range(self.group_size):
            self._submit(gid, idx)

    def _submit(self, gid: int, idx: int) -> None:
        pending = self._pending[gid]
        if pending.episodes is None:
            context, key = list(pending.prompt.prompt_ids), (self.seed, gid, idx, pending.attempts[idx])
        else:  # the next turn of a multi-turn episode: prompt + everything so far
            episode = pending.episodes[idx]
            context, key = episode.context(), (self.seed, gid, idx, pending.attempts[idx], episode.turns)
        # A distinct, reproducible seed per sample, attempt (and turn).
        seed = hash(key) & 0x7FFFFFFF
        sampling = dataclasses.replace(self.sampling, seed=seed)
        fut: Future = self.engine.generate(context, sampling, slot=ACTIVE)
        self._inflight += 1
        fut.add_done_callback(lambda f, g=gid, i=idx: self._events.put((g, i, f)))

    def _on_done(self, gid: int, idx: int, fut: Future) -> None:
        self._inflight -= 1
        completion: Completion = fut.result()  # an engine error propagates to the trainer
        self._record(completion)
        pending = self._pending[gid]
        if completion.finish_reason == "abort":
            # The engine aborted it (pause in abort mode, or its slot was overwritten): the
            # sample (a multi-turn episode: its current turn) is regenerated on the active slot.
            if not self._stop.is_set():
                pending.attempts[idx] += 1
                self.resubmitted += 1
                self._submit(gid, idx)
            return
        if pending.episodes is not None:
            episode = pending.episodes[idx]
            episode.add_turn(completion)
            if continue_episode(self.task, pending.prompt, episode, self.max_context) and not self._stop.is_set():
                self._submit(gid, idx)
                return
            completion = episode
        pending.completions[idx] = completion
        if all(c is not None for c in pending.completions):
            del self._pending[gid]
            self.buffer.put(build_group(self.task, pending.prompt, pending.completions, gid))

    def _record(self, c: Completion) -> None:
        if self.timeline is not None:
            self.timeline.event(
                "engine", "request", c.t_start, c.t_end, c.version_start,
                slot=c.slot, version_end=c.version_end, tokens=len(c.output_ids), finish=c.finish_reason,
            )
