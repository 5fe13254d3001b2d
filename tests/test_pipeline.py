"""Unit tests of the rollout pipeline (admission, in flight, complete, take) and of the pieces a
sample passes on its way: episodes, held interrupts. An engine double stands in for the engine:
these test one piece each; the end-to-end tests run the real engines."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from admission import RunAhead
from engine_helpers import FakeEngine

from orbit.engine.base import Completion
from orbit.engine.pool import EnginePool
from orbit.rl import AlgorithmConfig
from orbit.rollout.episode import Episode
from orbit.rollout.groups import Group, Signal
from orbit.rollout.pipeline import Pipeline, RolloutError
from orbit.rollout.sample import Sample
from orbit.run.loop import HeldInterrupt
from orbit.tasks.base import Prompt

PROMPT = Prompt(id="p", text="p", prompt_ids=(1, 2, 3))


def _pool(n: int = 1) -> EnginePool:
    return EnginePool([FakeEngine() for _ in range(n)], [8] * n, monitor=False)


def _pipeline(
    pool: EnginePool, batch: int = 2, k: int | None = 1, run_ahead: bool = False, **kw
) -> Pipeline:
    pipe = Pipeline(pool, batch, k, group_size=2, max_inflight=kw.pop("max_inflight", 64), **kw)
    if run_ahead:  # the former rule, bench/investigations/admission.py's
        pipe.admission = RunAhead(batch, k)
    return pipe


def _start_all(pipe: Pipeline) -> list[int]:
    """Start every group the pipeline admits now, submitting its requests as the producer does."""
    started = []
    while (s := pipe.start(PROMPT, multi_turn=False)) is not None:
        started.append(s[0])
        for _ in range(pipe.group_size):
            pipe.submitted()
    return started


def _complete(pipe: Pipeline, gid: int, rewards: tuple[float, float] = (0.0, 1.0)) -> None:
    version = pipe.in_flight[gid].version
    samples = [
        Sample(
            [1],
            [5, 6],
            [-0.1, -0.2],
            reward=r,
            version_start=version,
            version_end=version,
            group_id=gid,
        )
        for r in rewards
    ]
    pipe.complete(gid, Group(PROMPT, samples, gid))


def test_admission_starts_a_group_only_on_an_engine_fresh_enough():
    """B = 2, K = 1: with the engine at version v, at most (v + K + 1) * B groups may have
    started."""
    pool = _pool()
    pipe = _pipeline(pool)
    pipe.grant(100)
    assert _start_all(pipe) == [0, 1, 2, 3]  # (0 + 1 + 1) * 2
    pool.serves(pool.members[0], 1)
    assert _start_all(pipe) == [4, 5]
    assert {g.version for gid, g in pipe.in_flight.items() if gid >= 4} == {1}


def test_grants_and_room_in_flight_bound_what_starts():
    pipe = _pipeline(_pool(), k=5, max_inflight=5)  # room for two groups of two requests
    pipe.grant(1)
    assert _start_all(pipe) == [0]  # one grant
    pipe.grant(5)
    assert _start_all(pipe) == [1]  # 2 requests in flight + 2 <= 5; 2 more would not fit
    pipe.answered()
    pipe.answered()
    assert _start_all(pipe) == [2]  # two answered: room again


def test_run_ahead_counts_what_is_in_flight_or_buffered():
    pipe = _pipeline(_pool(), batch=2, k=1, run_ahead=True)
    pipe.grant(100)
    assert _start_all(pipe) == [0, 1, 2, 3]  # (K + 1) * B, whatever the version
    _complete(pipe, 0)
    _complete(pipe, 1)
    assert _start_all(pipe) == []  # complete but not taken: still in the pipeline
    pipe.take(2, version=0)
    assert _start_all(pipe) == [4, 5]


def test_take_hands_out_the_oldest_first():
    pool = _pool()
    pipe = _pipeline(pool, k=3)
    pipe.grant(100)
    _start_all(pipe)
    for gid in (3, 1, 0, 2):
        _complete(pipe, gid)
    batch = pipe.take(2, version=0)
    assert [g.id for g in batch.groups] == [0, 1] and batch.stale_dropped == 0
    assert len(batch.samples) == 4


def test_stale_groups_are_dropped_and_replaced():
    pool = _pool()
    pipe = _pipeline(pool, batch=1, k=0)
    pipe.grant(1)
    [gid] = _start_all(pipe)
    _complete(pipe, gid)  # started at version 0
    pool.serves(pool.members[0], 1)
    pipe.grant(1)
    [fresh] = _start_all(pipe)
    threading.Timer(0.2, lambda: _complete(pipe, fresh)).start()
    batch = pipe.take(1, version=1, stall_s=10)  # the version-0 group is too old at version 1
    assert (
        batch.stale_dropped == 1
        and batch.dropped_tokens == 4
        and [g.id for g in batch.groups] == [fresh]
    )
    # its replacement was granted: admission counts it as not started
    assert _start_all(pipe) == [2]


def test_dynamic_sampling_replaces_groups_without_signal_and_counts_them_apart():
    """A group whose rewards are all equal never reaches the trainer; another starts in its place,
    admission counting it as not started (so the staleness bound holds as for a dropped group), and
    the batch is full."""
    pool = _pool()
    pipe = _pipeline(
        pool, batch=2, k=0, keep=Signal(AlgorithmConfig(dynamic_sampling=True), 8).carries
    )
    pipe.grant(2)
    assert _start_all(pipe) == [0, 1]
    _complete(pipe, 0, (1.0, 1.0))  # no signal
    _complete(pipe, 1)
    assert pipe.counts.filtered == 1 and pipe.counts.filtered_tokens == 4
    # the replacement, at version 0: K = 0 admits exactly 2 groups at v0
    assert _start_all(pipe) == [2]
    assert _start_all(pipe) == []
    _complete(pipe, 2, (0.0, 0.5))
    batch = pipe.take(2, version=0, stall_s=5)
    assert [g.id for g in batch.groups] == [1, 2] and batch.stale_dropped == 0


def _filtering(**kw) -> Pipeline:
    """Dynamic sampling on batches of one group, stopping (or standing aside) after 2 batches of
    silent groups in a row."""
    keep = Signal(AlgorithmConfig(dynamic_sampling=True), 8).carries
    return _pipeline(_pool(), batch=1, k=None, filter_limit=2, keep=keep, **kw)


def test_dynamic_sampling_that_finds_no_signal_stops_the_run_saying_so():
    """Under a batch of groups has carried signal since the run started: the task gives this model
    nothing."""
    pipe = _filtering()
    pipe.grant(1)
    for _ in range(3):
        [gid] = _start_all(pipe)
        _complete(pipe, gid, (0.0, 0.0))
    with pytest.raises(
        RolloutError,
        match="dynamic sampling dropped 3 groups in a row whose rewards were all equal .*0 "
        "carried signal since the run started",
    ):
        pipe.take(1, version=0, stall_s=5)


def test_dynamic_sampling_stands_aside_once_a_learned_policy_gives_no_signal():
    """After a batch of groups that carried signal, a run of silent ones past the limit is a policy
    that has learned and settled on its answers: the run goes on, warned once, every group training
    as it comes (a silent group adds nothing to the loss)."""
    warned = []
    pipe = _filtering(on_warning=warned.append)
    pipe.grant(1)
    [gid] = _start_all(pipe)
    _complete(pipe, gid)  # signal
    assert [g.id for g in pipe.take(1, version=0, stall_s=5).groups] == [gid]
    pipe.grant(1)
    for _ in range(3):
        [gid] = _start_all(pipe)
        _complete(pipe, gid, (1.0, 1.0))
    assert pipe.counts.filtered == 3 and pipe.keep is None
    assert len(warned) == 1 and "Dynamic sampling stands aside for the rest of the run" in warned[0]
    [gid] = _start_all(pipe)
    _complete(pipe, gid, (1.0, 1.0))  # silent, and trained
    assert [g.id for g in pipe.take(1, version=1, stall_s=5).groups] == [gid]
    assert pipe.counts.filtered == 3 and len(warned) == 1


def test_a_resumed_run_keeps_dynamic_sampling_standing_aside():
    """The checkpoint's run state says the filter stood aside; the resumed run's pipeline trains a
    silent group as it comes instead of filtering again until it trips again. A run whose filter
    never stood aside filters again."""
    pipe = _filtering()
    assert pipe.run_state() == {"next_group": 0, "filter_stood_aside": False}
    pipe.grant(1)
    [gid] = _start_all(pipe)
    _complete(pipe, gid)  # signal
    pipe.take(1, version=0, stall_s=5)
    pipe.grant(1)
    for _ in range(3):
        [gid] = _start_all(pipe)
        _complete(pipe, gid, (1.0, 1.0))
    state = pipe.run_state()
    assert state == {"next_group": 4, "filter_stood_aside": True}

    resumed = _filtering(stood_aside=state["filter_stood_aside"])
    assert resumed.keep is None and resumed.run_state()["filter_stood_aside"]
    resumed.grant(1)
    [gid] = _start_all(resumed)
    _complete(resumed, gid, (1.0, 1.0))
    assert [g.id for g in resumed.take(1, version=1, stall_s=5).groups] == [gid]
    assert resumed.counts.filtered == 0
    assert _filtering(stood_aside=False).keep is not None


def test_lost_episodes_stop_the_run_only_past_the_share_of_a_batchs_worth():
    """Losses are judged once a batch's worth of episodes (2 groups of 2) ended since the last
    batch, each loss counted with its episode's end: three losses ending together first (a timed-out
    episode beside this batch's failures) do not stop the run, half lost does not, more than half
    does, naming the last reason."""
    pipe = _pipeline(_pool(), batch=2, k=None, max_lost_frac=0.5)
    pipe.grant(2)
    for why in ("timed out", "raised", "nan"):
        pipe.count(episodes_ended=1, episodes_lost=1, why=why)
    pipe.count(episodes_ended=3)
    assert pipe._verdict is None  # 3 of 6
    pipe.count(episodes_ended=1, episodes_lost=1, why="the agent raised ValueError")
    [gid, gid2] = _start_all(pipe)
    _complete(pipe, gid)
    _complete(pipe, gid2)
    with pytest.raises(
        RolloutError,
        match="4 of the last 7 agent episodes were lost .*max_lost_frac 0.5.*"
        "the last: the agent raised ValueError",
    ):
        pipe.take(2, version=0, stall_s=5)


def test_a_group_at_its_deadline_is_waited_for_not_overtaken():
    """B = 1, K = 1: a group started at version 0 must be trained at step 1; the trainer waits for
    it rather than taking a newer complete group past it (overtaken, it would go stale: a length
    bias)."""
    pool = _pool()
    pipe = _pipeline(pool, batch=1, k=1)
    pipe.grant(100)
    first, slow = _start_all(pipe)  # both at version 0
    _complete(pipe, first)
    assert [g.id for g in pipe.take(1, version=0).groups] == [first]
    pool.serves(pool.members[0], 1)
    [newer] = _start_all(pipe)  # at version 1
    _complete(pipe, newer)
    t0 = time.monotonic()
    threading.Timer(0.3, lambda: _complete(pipe, slow)).start()
    batch = pipe.take(1, version=1, stall_s=10)
    assert [g.id for g in batch.groups] == [slow] and time.monotonic() - t0 >= 0.25


def test_a_stall_says_what_was_seen():
    pipe = _pipeline(_pool(2))
    pipe.grant(3)
    _start_all(pipe)
    with pytest.raises(RolloutError) as err:
        pipe.take(1, version=0, stall_s=0.3)
    msg = str(err.value)
    assert "no rollout arrived for" in msg and "(rollout.stall_timeout_s: 0.3)" in msg
    assert "3 group(s) in flight (6 request(s))" in msg and "0 grant(s) left" in msg
    assert "engine 0: 0 running" in msg and "engine 1: 0 running" in msg


def test_an_engine_that_left_while_asked_is_named_with_the_pools_reason():
    """The stall asks each engine for its state; the ping drops a hung one meanwhile (and kills it):
    the description gives the reason it left, not the kill's own words."""

    class Hung(FakeEngine):
        def stats(self):
            time.sleep(0.3)
            raise RuntimeError("engine was killed")

    pool = EnginePool([Hung()], [8], monitor=False)
    threading.Timer(
        0.1, lambda: pool.drop(pool.members[0], "did not answer for 5 s (hung)")
    ).start()
    [(index, answer)] = pool.states(2.0)
    assert index == 0 and "left the pool: did not answer for 5 s (hung)" in str(answer)


def test_a_failed_producer_wakes_the_trainer_with_its_error():
    pipe = _pipeline(_pool())
    threading.Timer(0.2, lambda: pipe.fail(ValueError("broken"))).start()
    with pytest.raises(RolloutError, match="rollout producer failed: broken"):
        pipe.take(1, version=0, stall_s=10)


def test_the_trainer_says_when_it_waits_for_a_batch_and_when_it_stops_even_on_an_error():
    """What lends the trainer's threads to the engines (`on_wait`): told once as take starts to
    wait, once as it ends (a batch or an error); a batch already there is no wait."""
    pipe = _pipeline(_pool(), k=3)
    told: list[bool] = []
    pipe.on_wait = told.append
    pipe.grant(100)
    _start_all(pipe)
    _complete(pipe, 0)
    threading.Timer(0.5, lambda: _complete(pipe, 1)).start()
    assert [g.id for g in pipe.take(2, version=0).groups] == [0, 1]
    assert told == [True, False]
    _complete(pipe, 2)
    _complete(pipe, 3)
    pipe.take(2, version=0)
    assert told == [True, False]  # ready at once: it never waited
    threading.Timer(0.2, lambda: pipe.fail(ValueError("broken"))).start()
    with pytest.raises(RolloutError, match="broken"):
        pipe.take(2, version=0, stall_s=10)
    assert told == [True, False, True, False]


def test_an_episode_concatenates_turns_and_masks_what_was_injected():
    episode = Episode([1, 2])
    episode.add_turn(
        Completion([1, 2], [5, 6], [-0.5, -0.6], "stop", 0, 3, 3, t_start=1.0, t_end=2.0)
    )
    episode.inject([7, 8, 9])
    episode.add_turn(
        Completion([1, 2, 5, 6, 7, 8, 9], [10], [-0.1], "stop", 0, 4, 4, t_start=3.0, t_end=4.0)
    )
    assert episode.context() == [1, 2, 5, 6, 7, 8, 9, 10]
    assert episode.loss_mask == [1, 1, 0, 0, 0, 1] and episode.logprobs == [
        -0.5,
        -0.6,
        0.0,
        0.0,
        0.0,
        -0.1,
    ]
    assert (episode.version_start, episode.version_end, episode.turns, episode.tool_results) == (
        3,
        4,
        2,
        1,
    )
    assert (episode.t_start, episode.t_end) == (1.0, 4.0)


def test_ctrl_c_is_held_until_the_block_ends():
    reached = []
    with pytest.raises(KeyboardInterrupt):
        with HeldInterrupt():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            reached.append("end of the block")  # the step finished its line before the interrupt
    assert reached == ["end of the block"]
    with HeldInterrupt():  # nothing pending: nothing raised
        pass
