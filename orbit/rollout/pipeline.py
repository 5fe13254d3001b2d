"""The rollout pipeline: every group from its admission to the trainer's batch, under one lock.

The producer thread (producer.py) starts groups and fills them; the loop takes batches. Everything
both of them read and change lives here, under one condition:
- admission (docs/design.md §5): grants left, and groups started, counted the way admission counts
  them. A group is started only when it can be trained within K = max_staleness versions. Groups
  are trained in the order they start (`take` hands out the oldest first), B per step, so the g-th
  group of the run is trained at step g // B; started at version v its staleness is g // B - v <= K
  exactly when v >= g // B - K. So it starts on an engine serving at least that version, and waits
  until one does. Dropped groups do not count (each is replaced). Unbounded staleness admits as
  K = 1. (The former rule, at most (K + 1) batches in flight or buffered, started groups while the
  engine was a version behind: bench/investigations/admission.py measures it against this one.)
- in flight: the groups started and not complete, with the engine and version each started on;
- complete: scored groups waiting for the trainer (a group's samples are scored by the task when its
  last sample is done: groups.py). With dynamic sampling (`keep`), a group that carries no signal is
  dropped there and another started in its place, as a stale one is: it is counted as filtered, not
  as waste, and does not count as started. Staged sampling (`screen`, probes.py) probes a new
  prompt with a few samples first, outside admission: a prompt whose probe samples all reached the
  best reward seen is dropped there (counted as filtered and as screened); one that passes waits for
  admission and starts as a whole group of fresh samples, ahead of any new prompt.

`take(n, version)` drops groups too stale to train (each replaced by a fresh grant when
`replenish`), waits for a group still in flight at its deadline rather than overtaking it with
newer ones (overtaken, it would be dropped next step: a bias toward short rollouts), hands out the
oldest n, and stops a silent stall saying what was seen.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from orbit.engine.base import EngineDeadError, EngineStats, SamplingParams
from orbit.engine.pool import EnginePool
from orbit.rollout.episode import Episode
from orbit.rollout.groups import Group, Screen
from orbit.rollout.probes import Probes
from orbit.rollout.sample import Sample
from orbit.tasks.base import Prompt

_POLL_S = 0.5
_DESCRIBE_WAIT_S = 2.0


class RolloutError(RuntimeError):
    """Rollouts cannot go on: the producer failed (its cause is chained), a sample was aborted too
    often, or nothing arrived for `rollout.stall_timeout_s`. The message says what was seen."""


def sampling_params(rollout, stop_token_ids: tuple[int, ...]) -> SamplingParams:
    """The engine's sampling parameters for a recipe's rollout section."""
    return SamplingParams(
        max_new_tokens=rollout.max_new_tokens,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        stop_token_ids=stop_token_ids,
    )


# ---- the pipeline --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Admission:
    """Which groups may start: `batch` groups per train step, none trained more than `max_staleness`
    versions after the one its engine served when it started (None: unbounded, admitted as 1)."""

    batch: int
    max_staleness: int | None

    @property
    def k(self) -> int:
        return 1 if self.max_staleness is None else self.max_staleness

    def pick(self, pool: EnginePool, started: int, in_pipeline: int) -> int | None:  # noqa: ARG002
        """The engine the next group starts on, or None when none may start now. `started`: groups
        started so far (dropped ones not counted); `in_pipeline`: groups in flight or buffered (this
        rule does not need it). The g-th group is trained at step g // batch, so it starts on an
        engine serving at least g // batch - k."""
        return pool.pick(started // self.batch - self.k)


@dataclass
class InFlight:
    """A group started and not complete. Its samples' fields are the producer thread's alone."""

    prompt: Prompt
    engine: int  # the engine it runs on
    version: int  # the version its engine served when it started
    # per sample: a Completion or Episode, None until done
    completions: list = field(default_factory=list)
    attempts: list[int] = field(default_factory=list)
    episodes: list[Episode] | None = None  # multi-turn tasks: each sample's episode in progress
    # staged sampling: a probe of the prompt (its `k` samples decide whether a group starts), not
    # a group
    probe: bool = False
    probed: bool = False  # a group whose prompt's probe passed


@dataclass
class Batch:
    groups: list[Group]
    wait_s: float  # time the trainer was blocked waiting for it
    stale_dropped: int  # groups dropped as too stale while assembling it
    dropped_tokens: int = 0  # tokens generated for those dropped groups (waste)

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g.samples]


@dataclass
class Counts:
    """Running totals of the rollout side, read by the loop for each step's metrics."""

    resubmitted: int = 0  # samples resubmitted after the engine aborted them
    aborted_tokens: int = 0  # tokens generated by requests that ended aborted (waste)
    filtered: int = 0  # groups dropped for carrying no signal (dynamic sampling)
    filtered_tokens: int = 0  # their tokens (not waste: they were looked at, and said nothing)
    screened: int = 0  # of the filtered: prompts dropped on their probe (staged sampling)
    episodes_ended: int = 0  # agent episodes that ended, lost or not
    # agent episodes that failed (the agent raised, hung, or gave a bad reward)
    episodes_lost: int = 0


class Pipeline:
    def __init__(
        self,
        pool: EnginePool,
        batch: int,
        max_staleness: int | None,
        group_size: int,
        max_inflight: int,
        replenish: bool = True,
        start_group: int = 0,
        start_version: int = 0,
        keep: Callable[[Group], bool] | None = None,
        stood_aside: bool = False,
        filter_limit: int = 10,
        max_lost_frac: float = 0.5,
        on_warning: Callable[[str], None] | None = None,
        screen: Screen | None = None,
    ) -> None:
        """`batch`: groups per train step. `max_staleness`: how many versions a group may be trained
        after the one it started on (the mode's: `Mode.max_staleness`); admission keeps groups
        within it, and a complete group past it is dropped (None: unbounded, never dropped).
        `max_inflight`: requests in flight at most, over all engines. `start_group` /
        `start_version`: where a resumed run's prompt stream and versions stand. `keep`: dynamic
        sampling's test of a complete group; `filter_limit` batches' worth of groups failing it
        while the trainer waits for one batch stop the run if under a batch's worth has passed it
        yet, else dynamic sampling stands aside for the rest of the run (`on_warning` says so);
        `stood_aside`: it did so before the run was resumed (`run_state` keeps it). Losing more
        than `max_lost_frac` of the agent episodes since the last batch stops the run. `screen`:
        staged sampling, with `keep`: a new prompt starts as a probe of `screen.k` samples, and its
        group only when those did not all reach the best reward seen (probes.py)."""
        self.pool, self.group_size, self.max_inflight = pool, group_size, max_inflight
        self.admission = Admission(batch, max_staleness)
        self.replenish = replenish
        self.keep = None if stood_aside else keep
        window = (self.admission.k + 1) * batch
        self.probes = Probes(screen, window) if screen is not None and keep is not None else None
        self.filter_limit = filter_limit
        self.stood_aside = stood_aside
        # groups' worth of samples dropped while the trainer waited (a screened probe: k / n)
        self._filtered_since_take = 0.0
        # groups that carried signal in this run (a resumed run has trained batches of them)
        self._kept = start_version * batch
        self.on_warning = on_warning or (lambda message: None)
        self.max_lost_frac = max_lost_frac
        self._since_take = (0, 0)  # agent episodes ended and lost when the last batch was taken
        self._last_loss = ""
        self.counts = Counts()
        # the group number (and prompt index) of the next group started
        self.next_group = start_group
        self.in_flight: dict[int, InFlight] = {}
        self._cond = threading.Condition()
        self._granted = 0
        self._started = start_version * batch  # every group trained before this run counts
        self._requests = 0  # requests in flight
        # told when the engines have nothing in flight, or again do
        self.on_idle: Callable[[bool], None] | None = None
        # told when the trainer starts waiting for a batch, and when it stops (under the lock:
        # it must not block)
        self.on_wait: Callable[[bool], None] | None = None
        self._waiting = False  # the trainer is in take, waiting
        self._complete: list[Group] = []
        self._error: BaseException | None = None  # the producer's
        self._verdict: RolloutError | None = None
        self._interrupted = False
        self._last_progress = time.monotonic()
        self._events: queue.Queue = queue.Queue()  # the producer's: answered requests, and wake-ups
        pool.listen(self.wake)  # a version or liveness change may open admission

    # ---- the producer's side -------------------------------------------------------------------

    def start(self, prompt: Prompt, multi_turn: bool) -> tuple[int, InFlight] | None:
        """Start a group of `prompt` if one may start now, or a probe of it while probes run:
        (its number, the group or probe in flight, on the engine the pool picked); None when
        neither may start (no grant, no room in flight, no engine fresh enough; no probe wanted, or
        a passed prompt waiting for room)."""
        with self._cond:
            if self._probing():
                return self._start_probe(prompt, multi_turn)
            return self._start_group(prompt, multi_turn, None)

    def start_passed(self, multi_turn: bool) -> tuple[int, InFlight] | None:
        """Start the group of the oldest prompt whose probe passed, if one may start now."""
        with self._cond:
            if self.probes is None or not self.probes.passed:
                return None
            gid, prompt = self.probes.passed[0]
            started = self._start_group(prompt, multi_turn, gid)
            if started is not None:
                self.probes.passed.popleft()
                started[1].probed = True
            return started

    def _start_group(
        self, prompt: Prompt, multi_turn: bool, gid: int | None
    ) -> tuple[int, InFlight] | None:
        """A whole group under admission; `gid`: its probe's number (None: a new prompt's)."""
        if not self._room(self.group_size):
            return None
        engine = self._admitted()
        if engine is None:
            return None
        self._granted -= 1
        self._started += 1
        return self._in_flight(prompt, multi_turn, gid, engine, self.group_size)

    def _admitted(self) -> int | None:
        """The engine the next group would start on, if a grant is left and admission lets it
        start now (room in flight aside)."""
        if self._granted <= 0:
            return None
        in_pipeline = len(self._complete) + len(self.in_flight)
        return self.admission.pick(self.pool, self._started, in_pipeline)

    def _probing(self) -> bool:
        """Do new prompts start as probes: staged sampling, with dynamic sampling on (when it
        stands aside, prompts start as groups again), once enough were screened out."""
        return self.probes is not None and self.keep is not None and self.probes.on()

    def _start_probe(self, prompt: Prompt, multi_turn: bool) -> tuple[int, InFlight] | None:
        """A probe, outside admission: while one is wanted and there is room for it, and no passed
        prompt could start but for room (its group needs the rows first)."""
        assert self.probes is not None
        k = self.probes.k
        # a passed prompt that admission would start now waits only for room: its group goes first
        passed_waits = bool(self.probes.passed) and self._admitted() is not None
        if not self.probes.wanted(self._granted) or not self._room(k) or passed_waits:
            return None
        # an engine as fresh as the next group's: a lagging one would judge with an old policy
        engine = self.admission.pick(self.pool, self._started, 0)
        if engine is None:
            return None
        self.probes.pending += 1
        return self._in_flight(prompt, multi_turn, None, engine, k, probe=True)

    def _in_flight(
        self,
        prompt: Prompt,
        multi_turn: bool,
        gid: int | None,
        engine: int,
        n: int,
        probe: bool = False,
    ) -> tuple[int, InFlight]:
        if gid is None:
            gid, self.next_group = self.next_group, self.next_group + 1
        episodes = [Episode(list(prompt.prompt_ids)) for _ in range(n)] if multi_turn else None
        group = self.in_flight[gid] = InFlight(
            prompt, engine, self.pool.versions()[engine] or 0, [None] * n, [0] * n, episodes
        )
        group.probe = probe
        return gid, group

    def _room(self, requests: int) -> bool:
        return self._requests + requests <= self.max_inflight

    def screened(self, gid: int, first: Group | None) -> None:
        """A probe is done: `first` holds its samples, scored (None: every one of them was a lost
        episode). Screened out (they all reached the best reward seen): the prompt is dropped as
        dynamic sampling drops a complete group, and toward `filter_limit` it counts as the share
        of a group it cost. Else the prompt waits for its group to start (`start_passed`)."""
        assert self.probes is not None
        solved = first is not None and self.keep is not None and self.probes.screen.solved(first)
        warning = None
        with self._cond:
            probe = self.in_flight.pop(gid)
            self.probes.pending -= 1
            self.probes.judged(not solved)
            self._last_progress = time.monotonic()
            if solved:
                assert first is not None
                self.counts.screened += 1
                warning = self._filter(first, len(first.samples) / self.group_size, probe=True)
            else:
                self.probes.passed.append((gid, probe.prompt))
            self._cond.notify_all()
        if warning:
            self.on_warning(warning)
        self.wake()  # a group, or the next probe, may start now

    def submitted(self) -> None:
        with self._cond:
            self._requests += 1
            if self.on_idle is not None and self._requests == 1:
                self.on_idle(False)

    def answered(self) -> None:
        """A request finished: the pipeline is alive."""
        with self._cond:
            self._requests -= 1
            self._last_progress = time.monotonic()
            if self.on_idle is not None and self._requests == 0:
                self.on_idle(True)  # nothing to generate: the trainer may borrow the engines' cores

    def complete(self, gid: int, group: Group) -> None:
        # outside the lock: the rewards are the group's own
        keep = self.keep
        kept = keep is None or keep(group)
        verdict = None
        if self.probes is not None:
            self.probes.screen.seen(group)
            verdict = not self.probes.screen.would_solve(group)
        warning = None
        with self._cond:
            probed = self.in_flight.pop(gid).probed
            if verdict is not None and self.probes is not None and not probed:
                self.probes.judged(verdict)  # what a probe of it would have found
            self._last_progress = time.monotonic()
            if kept:
                self._complete.append(group)
                self._kept += keep is not None
            else:
                warning = self._filter(group)
            self._cond.notify_all()
        if warning:
            self.on_warning(warning)
        if not kept:
            self.wake()  # its replacement starts now

    def _filter(self, group: Group, share: float = 1.0, probe: bool = False) -> str | None:
        """Dynamic sampling: the group says nothing; another prompt's group takes its place (a
        probe never counted as started, so there is nothing to give back). Past
        the limit: the run stops if under a batch of groups has carried signal (the task gives this
        model nothing to learn from), else the filter stands aside (the policy has learned and
        settled on its answers: a run of silent groups that would otherwise end it); what to warn
        of."""
        self.counts.filtered += 1
        self.counts.filtered_tokens += group.tokens
        if not probe:
            self._started -= 1  # its replacement counts as started instead, as a dropped group's
            self._granted += 1
        self._filtered_since_take += share
        if (
            self._filtered_since_take <= self.filter_limit * self.admission.batch
            or self._verdict is not None
        ):
            return None
        dropped = (
            f"dynamic sampling dropped {self._filtered_since_take:g} groups in a row whose rewards "
            f"were all equal (algorithm.filter_limit: {self.filter_limit} batches of "
            f"{self.admission.batch})"
        )
        if self._kept < self.admission.batch:
            self._verdict = RolloutError(
                f"{dropped}, and {self._kept} carried signal since the run started; the task "
                "gives this model no signal: every answer right or every answer wrong"
            )
            return None
        self.keep, self.stood_aside = None, True
        return (
            f"{dropped}, after {self._kept} that carried signal: the policy has settled on its "
            "answers. Dynamic sampling stands aside for the rest of the run: every group trains "
            "as it comes (one whose rewards are all equal adds nothing)"
        )

    def count(
        self,
        resubmitted: int = 0,
        aborted_tokens: int = 0,
        episodes_ended: int = 0,
        episodes_lost: int = 0,
        why: str = "",
    ) -> None:
        """Add to the running totals; `why`: a lost episode's reason (the run's stop names the last
        one)."""
        with self._cond:
            self._last_loss = why.partition("\n")[0] or self._last_loss
            self.counts.resubmitted += resubmitted
            self.counts.aborted_tokens += aborted_tokens
            self.counts.episodes_ended += episodes_ended
            self.counts.episodes_lost += episodes_lost
            self._check_losses()

    def _check_losses(self) -> None:
        """Stop when more than `max_lost_frac` of the episodes that ended since the last batch were
        lost, once a batch's worth ended: the agent fails, not an episode now and then. (A smaller
        window trips on a few losses that end together, such as a timed-out episode finishing beside
        this batch's.)"""
        ended = self.counts.episodes_ended - self._since_take[0]
        lost = self.counts.episodes_lost - self._since_take[1]
        enough = ended >= self.group_size * self.admission.batch
        if enough and lost / ended > self.max_lost_frac and self._verdict is None:
            self._verdict = RolloutError(
                f"{lost} of the last {ended} agent episodes were lost (more than "
                f"rollout.max_lost_frac {self.max_lost_frac:g}); the last: {self._last_loss}"
            )
            self._cond.notify_all()

    def drop(self, gid: int) -> None:
        """A group with nothing to train on (every episode lost): another prompt's group takes its
        place."""
        with self._cond:
            del self.in_flight[gid]
            self._started -= 1
            self._granted += 1
            self._last_progress = time.monotonic()
        self.wake()

    def fail(self, error: BaseException) -> None:
        """The producer died: wake the trainer with its error instead of letting it wait."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def interrupt(self) -> None:
        """Ctrl-C for a loop that is not on the main thread (a sweep's run): its next `take`, or the
        one it waits in, raises KeyboardInterrupt."""
        with self._cond:
            self._interrupted = True
            self._cond.notify_all()

    def post(self, event: tuple | None) -> None:
        self._events.put(event)

    def next_event(self) -> tuple | None:
        """The producer's next event: an answered request (group, sample, future), or None
        (re-check)."""
        return self._events.get()

    def wake(self) -> None:
        """Admission may have opened: let the producer re-check."""
        self._events.put(None)

    # ---- the loop's side -----------------------------------------------------------------------

    def run_state(self) -> dict:
        """What a checkpoint keeps of the producer: where the prompt stream stands, and whether
        dynamic sampling stood aside (a resumed run must not filter again until it trips again)."""
        with self._cond:
            return {"next_group": self.next_group, "filter_stood_aside": self.stood_aside}

    def grant(self, n_groups: int) -> None:
        """Allow `n_groups` more groups to start."""
        with self._cond:
            self._granted += n_groups
        self.wake()

    def take(self, n: int, version: int, stall_s: float | None = None) -> Batch:
        """Block until `n` fresh-enough groups are complete for training at `version`; take the ones
        that started earliest. RolloutError when the producer failed, or when nothing at all
        happened on the rollout side for `stall_s` seconds (the message says what was in flight)."""
        t0 = time.time()
        with self._cond:
            try:
                taken, stalled, dropped = self._await(n, version, stall_s)
            finally:
                self._trainer_waits(False)
            self._filtered_since_take = 0
            self._since_take = (self.counts.episodes_ended, self.counts.episodes_lost)
        # the engines are asked outside the lock: the producer must not wait on a hung engine
        if stalled:
            raise RolloutError(f"{stalled}; {self._engines()}")
        self.wake()  # room in the pipeline (an admission may count what is buffered)
        return Batch(
            groups=taken,
            wait_s=time.time() - t0,
            stale_dropped=len(dropped),
            dropped_tokens=sum(g.tokens for g in dropped),
        )

    def _await(
        self, n: int, version: int, stall_s: float | None
    ) -> tuple[list[Group], str, list[Group]]:
        """take's wait, under the lock: (the groups taken, why it stalled, the stale groups
        dropped)."""
        dropped: list[Group] = []
        taken: list[Group] = []
        stalled = ""
        while not taken and not stalled:
            if self._interrupted:
                raise KeyboardInterrupt
            if self._verdict is not None:
                raise self._verdict  # the pipeline's own (dynamic sampling found no signal)
            if self._error is not None:
                raise RolloutError(f"rollout producer failed: {self._error}") from self._error
            dropped += self._drop_stale(version)
            quiet = time.monotonic() - self._last_progress
            if len(self._complete) >= n and not self._due(version):
                self._complete.sort(key=lambda g: (g.oldest_version, g.id))
                taken, self._complete = self._complete[:n], self._complete[n:]
            elif stall_s is not None and quiet > stall_s:
                stalled = (
                    f"no rollout arrived for {quiet:.0f} s (rollout.stall_timeout_s: "
                    f"{stall_s:g}) while the trainer waited for {n} groups at version "
                    f"{version}; {self._seen()}"
                )
            else:
                self._trainer_waits(True)  # its threads may generate meanwhile
                self._cond.wait(timeout=_POLL_S)
        return taken, stalled, dropped

    def _trainer_waits(self, waits: bool) -> None:
        if waits != self._waiting and self.on_wait is not None:
            self.on_wait(waits)
        self._waiting = waits

    def _due(self, version: int) -> bool:
        """Is a group still in flight that must be trained at this step (started at version - K)?"""
        k = self.admission.max_staleness
        return k is not None and any(
            g.version == version - k and not g.probe for g in self.in_flight.values()
        )

    def _drop_stale(self, version: int) -> list[Group]:
        k = self.admission.max_staleness
        if k is None:
            return []
        stale = [g for g in self._complete if g.staleness(version) > k]
        if stale:
            self._complete = [g for g in self._complete if g.staleness(version) <= k]
            self._started -= len(stale)  # they no longer count as started: their replacements do
            if self.replenish:
                self._granted += len(stale)
            self.wake()  # at once: the replacements must start while the trainer waits
        return stale

    def _seen(self) -> str:
        probes = ""
        if self.probes is not None and (self.probes.pending or self.probes.passed):
            probes = (
                f"; {self.probes.pending} probe(s) in flight and {len(self.probes.passed)} "
                "passed, waiting"
            )
        return (
            f"{len(self._complete)} complete group(s) buffered; {len(self.in_flight)} group(s) in "
            f"flight ({self._requests} request(s)){probes}; {self._granted} grant(s) left; "
            f"{self._started} group(s) started (max_staleness {self.admission.max_staleness}, "
            f"engine versions {self.pool.versions()})"
        )

    def _engines(self) -> str:
        """What each engine is doing, each asked for at most a few seconds (one may be hung)."""
        return "; ".join(_describe_member(i, s) for i, s in self.pool.states(_DESCRIBE_WAIT_S))


def _describe_member(i: int, s: EngineStats | BaseException) -> str:
    if isinstance(s, EngineDeadError):  # it left the pool, or says itself that it is hung
        return f"engine {i}: {s}"
    if isinstance(s, BaseException):
        return f"engine {i}: no answer within {_DESCRIBE_WAIT_S:g} s ({type(s).__name__}: {s})"
    return (
        f"engine {i}: {s.running} running, {s.waiting} waiting, "
        f"{'paused' if s.paused else 'not paused'}, active slot {s.active_slot}"
    )
