"""The rollout producer: a background thread that keeps the engines fed with whole groups.

It starts every group the pipeline admits (pipeline.py), on the engine the pool picked, as
`group_size` requests on that engine's active slot (the samples share the prompt's prefix cache), so
up to `max_inflight` requests stay in flight. When one is answered it resubmits a sample the engine
aborted (at most `rollout.max_attempts` times), runs the next turn of a multi-turn episode
(episode.py), and once every sample of a group is done scores the group (pipeline.py) and hands it
to the pipeline. With staged sampling (`algorithm.screen`, probes.py) a new prompt may start as a
probe of a few samples instead; once they are scored the pipeline drops the prompt or queues it,
and a queued prompt's group starts ahead of any new prompt. The two loop kinds differ only in
grants: serial grants one batch per step, overlapped grants the whole run at start (and each dropped
group is granted again).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from orbit.agents.runner import AgentRunner, EpisodeFailed
from orbit.engine.base import ACTIVE, Completion, SamplingParams
from orbit.engine.pool import EnginePool
from orbit.metrics.steps import Timeline
from orbit.rollout.episode import continue_episode, with_task_stops
from orbit.rollout.groups import build_group
from orbit.rollout.pipeline import InFlight, Pipeline, RolloutError
from orbit.tasks.base import Prompt, Task, TaskError, is_multi_turn

LOST = object()  # an agent episode that failed: left out of its group


class Producer:
    def __init__(
        self,
        pipeline: Pipeline,
        pool: EnginePool,
        task: Task,
        sampling: SamplingParams,
        seed: int,
        timeline: Timeline | None = None,
        max_attempts: int = 8,
        adapter: str | None = None,
        agents: AgentRunner | None = None,
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        """`agents`: an agent task's episodes run there (orbit/agents); `on_lost`: told of each lost
        episode."""
        self.pipeline, self.pool, self.task, self.seed, self.timeline = (
            pipeline,
            pool,
            task,
            seed,
            timeline,
        )
        self.agents, self.on_lost = agents, on_lost
        self.sampling = with_task_stops(sampling, task)  # + the task's own (a tool call's end)
        self.multi_turn = is_multi_turn(task)
        self.max_attempts = max_attempts
        self.adapter = adapter  # a sweep's run: its requests' timeline events name it
        self._prompts = task.prompts(seed)
        # a resumed run continues the prompt stream where it stopped
        for _ in range(pipeline.next_group):
            self._next_prompt()
        self._ready: Prompt | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="orbit-producer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.pipeline.wake()
        self._thread.join(timeout=10)

    # ---- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._fill()
                event = self.pipeline.next_event()
                if event is not None:
                    self._on_done(*event)
        except BaseException as err:  # noqa: BLE001 - any failure must reach the trainer
            self.pipeline.fail(err)

    def _fill(self) -> None:
        while not self._stop.is_set():
            # a prompt whose probe passed starts its group before any new prompt starts
            started = self.pipeline.start_passed(self.multi_turn)
            if started is None:
                # the next prompt is read ahead: the task runs outside the pipeline's lock, and
                # prompts are still taken strictly in group order (a resumed run skips exactly the
                # groups it started)
                self._ready = self._ready or self._next_prompt()
                started = self.pipeline.start(self._ready, self.multi_turn)
                if started is None:
                    return
                self._ready = None
            gid, group = started
            for idx in range(len(group.completions)):
                self._submit(gid, idx, group)

    def _next_prompt(self) -> Prompt:
        try:
            return next(self._prompts)
        except StopIteration:
            raise TaskError(
                f"task {self.task.name!r}: prompts() ran out; a task's prompt stream must be "
                "endless (cycle through a dataset)"
            ) from None
        except Exception as err:  # noqa: BLE001 - a failing task stops the run, named
            raise TaskError(
                f"task {self.task.name!r}: prompts() failed: {type(err).__name__}: {err}"
            ) from err

    def _submit(self, gid: int, idx: int, group: InFlight) -> None:
        """Sample `idx` of a group (its next turn, multi-turn; an agent's whole episode) on the
        group's engine: the prompt's prefix cache (an episode's context) is there. The pool reroutes
        if that engine is gone."""
        # a probe's samples have seeds of their own: its group is a fresh draw, not its replay
        draw = idx + self.pipeline.group_size if group.probe else idx
        meta = {"group": gid, "probe": True} if group.probe else {"group": gid}
        if self.agents is not None:
            name = f"s{self.seed}-g{gid}-{draw}-{group.attempts[idx]}"
            episode_fut = self.agents.start(group.prompt, group.engine, ACTIVE, name, meta=meta)
            self._post_when_done(episode_fut, gid, idx)
            return
        key: tuple[int, ...] = (self.seed, gid, draw, group.attempts[idx])
        if group.episodes is None:
            context = list(group.prompt.prompt_ids)
        else:  # the next turn of a multi-turn episode: prompt + everything so far
            episode = group.episodes[idx]
            context, key = episode.context(), (*key, episode.turns)
        # A distinct, reproducible seed per sample, attempt (and turn): ints hash the same in every
        # run.
        sampling = dataclasses.replace(self.sampling, seed=hash(key) & 0x7FFFFFFF)
        fut = self.pool.generate(context, sampling, slot=ACTIVE, engine=group.engine, meta=meta)
        self._post_when_done(fut, gid, idx)

    def _post_when_done(self, fut: Future[Any], gid: int, idx: int) -> None:
        """The request is in flight; its answer goes to the producer's queue."""
        self.pipeline.submitted()
        fut.add_done_callback(lambda f: self.pipeline.post((gid, idx, f)))

    def _on_done(self, gid: int, idx: int, fut: Future) -> None:
        self.pipeline.answered()
        try:
            completion: Completion = fut.result()  # an engine error propagates to the trainer
        except EpisodeFailed as err:
            self._lost(gid, idx, err)
            return
        group = self.pipeline.in_flight[gid]
        if self.agents is not None:  # its calls were recorded as they were answered
            self._done(gid, idx, group, completion)
            return
        self.record(completion)
        # where it ran (the pool may have moved it off a dead engine)
        group.engine = completion.engine
        if completion.finish_reason == "abort":
            self.pipeline.count(aborted_tokens=len(completion.output_ids))
            self._retry(gid, idx, group, completion)
            return
        if group.episodes is not None:
            episode = group.episodes[idx]
            episode.add_turn(completion)
            if (
                continue_episode(self.task, group.prompt, episode, self.pool.info.max_context)
                and not self._stop.is_set()
            ):
                self._submit(gid, idx, group)
                return
            self._done(gid, idx, group, episode)
            return
        self._done(gid, idx, group, completion)

    def _done(self, gid: int, idx: int, group: InFlight, completion, why: str = "") -> None:
        # an episode's end and its loss in one count: the check sees both at once
        if self.agents is not None:
            self.pipeline.count(episodes_ended=1, episodes_lost=int(completion is LOST), why=why)
        group.completions[idx] = completion
        if any(c is None for c in group.completions):
            return
        if group.probe:
            self._screen(gid, group)
            return
        kept = [c for c in group.completions if c is not LOST]
        if kept:
            self.pipeline.complete(gid, build_group(self.task, group.prompt, kept, gid))
        else:  # every episode of the group was lost: another prompt's group takes its place
            self.pipeline.drop(gid)

    def _screen(self, gid: int, probe: InFlight) -> None:
        """Staged sampling: a probe's samples are done; the pipeline scores them and drops the
        prompt or queues its group (the task's score is cheap beside generation)."""
        kept = [c for c in probe.completions if c is not LOST]
        self.pipeline.screened(
            gid, build_group(self.task, probe.prompt, kept, gid) if kept else None
        )

    def _lost(self, gid: int, idx: int, err: EpisodeFailed) -> None:
        """An agent episode that failed: counted, told, and left out of its group; the run goes
        on."""
        group = self.pipeline.in_flight[gid]
        if self.on_lost is not None:
            self.on_lost(
                f"episode {idx} of group {gid} (prompt {group.prompt.id!r}) was lost: {err}"
            )
        self._done(gid, idx, group, LOST, why=str(err))

    def _retry(self, gid: int, idx: int, group: InFlight, completion: Completion) -> None:
        """The engine aborted the sample (a pause in abort mode, its slot overwritten): regenerate
        it (a multi-turn episode: its current turn) on the active slot, at most `max_attempts`
        times."""
        if self._stop.is_set():
            return
        group.attempts[idx] += 1
        if group.attempts[idx] >= self.max_attempts:
            detail = f" ({completion.detail})" if completion.detail else ""
            raise RolloutError(
                f"prompt {group.prompt.id!r}: sample {idx} of group {gid} was aborted "
                f"{group.attempts[idx]} times (rollout.max_attempts: {self.max_attempts}); last "
                f"finish reason {completion.finish_reason!r}{detail}"
            )
        self.pipeline.count(resubmitted=1)
        self._submit(gid, idx, group)

    def record(self, c: Completion) -> None:
        """A finished request as a timeline event (an agent's calls come here from the endpoint)."""
        if self.timeline is not None:
            self.timeline.event(
                "engine",
                "request",
                c.t_start,
                c.t_end,
                c.version_start,
                engine=c.engine,
                slot=c.slot,
                version_end=c.version_end,
                tokens=len(c.output_ids),
                finish=c.finish_reason,
                group=(c.meta or {}).get("group"),
                **({"probe": True} if (c.meta or {}).get("probe") else {}),
                **({"adapter": self.adapter} if self.adapter else {}),
            )
