"""Staged sampling (`algorithm.screen`): a group starts with its first samples, and the rest are
generated unless all of those reached the best reward seen. Unit tests of the producer and pipeline
over an engine double that answers from the request's seed (one piece: the real engine runs it in
tests/test_train_modes.py, and the laptop recipe in bench/learning.py)."""

from __future__ import annotations

import random
import threading
from collections import Counter
from concurrent.futures import Future

import pytest
from engine_helpers import FakeEngine

from orbit.config import RecipeError, parse_recipe
from orbit.engine.base import Completion, SamplingParams
from orbit.engine.pool import EnginePool
from orbit.rl import AlgorithmConfig
from orbit.rollout.groups import Screen, Signal, build_group
from orbit.rollout.pipeline import Pipeline
from orbit.rollout.producer import Producer
from orbit.tasks.base import Prompt, Score

GROUP = 8


class PassRateTask:
    """Prompt i is answered right with probability `rates[i % len(rates)]`: the engine double's
    answer is 1 (right) or 0, drawn from the request's own seed."""

    name = "pass-rate"

    def __init__(self, rates: list[float]) -> None:
        self.rates = rates

    def prompts(self, seed: int, split: str = "train"):
        i = 0
        while True:
            yield Prompt(id=str(i), text="", prompt_ids=(1, 10 + i % 1000, i // 1000))
            i += 1

    def score(self, prompt: Prompt, output_ids: list[int]) -> Score:
        return Score(reward=float(output_ids[0]), info={})


class SeededEngine(FakeEngine):
    """Answers each request on a thread of its own after `delay` seconds, right with its prompt's
    pass rate, with the weights of `version`; records the requests per prompt, the most ever in
    flight, and how many were in flight as each arrived."""

    def __init__(self, task: PassRateTask, delay: float = 0.001) -> None:
        super().__init__()
        self.task, self.delay, self.version = task, delay, 0
        self.requests: Counter[tuple[int, ...]] = Counter()
        self.in_flight = self.most_in_flight = 0
        self.rows: list[int] = []
        self.lock = threading.Lock()

    def generate(self, prompt_ids, sampling: SamplingParams, slot="active", meta=None) -> Future:
        rate = self.task.rates[(prompt_ids[1] - 10 + 1000 * prompt_ids[2]) % len(self.task.rates)]
        right = int(random.Random(sampling.seed).random() < rate)
        with self.lock:
            self.requests[tuple(prompt_ids)] += 1
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            self.rows.append(self.in_flight)
        fut: Future = Future()
        version = self.version

        def answer() -> None:
            with self.lock:
                self.in_flight -= 1
            completion = Completion(
                list(prompt_ids), [right], [-0.5], "stop", None, version, version
            )
            fut.set_result(completion)

        threading.Timer(self.delay, answer).start()
        return fut


def _batches(
    task: PassRateTask,
    screen: int | None,
    groups: int,
    max_inflight: int = 24,
    min_screened: float = 0.0,
):
    """`groups` groups that carried signal, from a real Producer and Pipeline; with the engine and
    pipeline, to read what it took. Groups start as probes from the first (`min_screened` 0)."""
    engine = SeededEngine(task)
    pool = EnginePool([engine], [max_inflight], monitor=False)
    signal = Signal(AlgorithmConfig(dynamic_sampling=True, screen=screen), 1)
    pipeline = Pipeline(
        pool,
        groups,
        None,
        GROUP,
        max_inflight,
        keep=signal.carries,
        screen=Screen(screen, signal, min_screened=min_screened) if screen else None,
        filter_limit=1000,
    )
    producer = Producer(pipeline, pool, task, SamplingParams(max_new_tokens=1), seed=0)
    pipeline.grant(groups)
    producer.start()
    try:
        batch = pipeline.take(groups, version=0, stall_s=60)
    finally:
        producer.stop()
    return batch, engine, pipeline


def test_a_group_whose_first_samples_are_all_right_is_dropped_before_its_rest_is_generated():
    # prompts 0, 3, 6... always right, 1, 4, 7... always wrong, the others right half the time
    batch, engine, pipeline = _batches(PassRateTask([1.0, 0.0, 0.5]), screen=2, groups=6)
    per_prompt = {ids[1] - 10: n for ids, n in engine.requests.items()}
    # once a right and a wrong answer were seen, a solved prompt stops at its first two
    solved = [per_prompt[i] for i in sorted(per_prompt) if i % 3 == 0]
    assert solved[-3:] == [2, 2, 2] and max(solved) <= GROUP
    # a prompt always failed is never screened: its whole group is generated (and then dropped
    # by dynamic sampling, complete); the last few may still be in flight
    failed = [per_prompt[i] for i in sorted(per_prompt) if i % 3 == 1]
    assert sum(n == GROUP for n in failed) >= len(failed) - 4
    trained = {int(g.prompt.id) for g in batch.groups}
    assert all(i % 3 == 2 and per_prompt[i] == GROUP for i in trained)
    assert all(len({s.reward for s in g.samples}) == 2 for g in batch.groups)
    c = pipeline.counts
    assert 0 < c.screened < c.filtered  # the failed groups are filtered whole, not screened
    assert engine.most_in_flight <= 24  # the rest waits for room under max_inflight


def test_without_screen_every_sample_of_a_group_is_generated():
    batch, engine, pipeline = _batches(PassRateTask([1.0, 0.0, 0.5]), screen=None, groups=6)
    assert set(engine.requests.values()) == {GROUP}
    assert pipeline.counts.screened == 0 and pipeline.counts.filtered >= 6


@pytest.mark.parametrize("rate", [0.9, 0.5])
def test_a_prompt_is_screened_out_with_the_chance_its_first_samples_are_all_right(rate):
    """The bias docs/algorithms.md states: with a right answer worth the best reward, staged
    sampling drops a prompt of pass rate p at its first k samples with probability p^k, so it
    trains it with probability 1 - p^k - (1-p)^n where dynamic sampling alone does with
    1 - p^n - (1-p)^n. The seeds are fixed, so the share is the same on every run."""
    k, groups = 2, 200
    _, engine, pipeline = _batches(PassRateTask([rate]), screen=k, groups=groups, max_inflight=64)
    # every group's prompt is its own; a group past its first samples was not screened out
    went_on = sum(n > k for n in engine.requests.values())
    judged = went_on + pipeline.counts.screened
    share = pipeline.counts.screened / judged
    assert went_on >= groups and abs(share - rate**k) < 0.04, (share, judged)


def test_screen_is_checked_against_the_group_and_dynamic_sampling():
    with pytest.raises(RecipeError, match=r"algorithm.screen \(8\).*rollout.group_size \(8\)"):
        parse_recipe({"model": "m", "algorithm": {"screen": 8}, "rollout": {"group_size": 8}})
    with pytest.raises(RecipeError, match="algorithm.screen: .*dynamic_sampling is off"):
        parse_recipe({"model": "m", "algorithm": {"screen": 2, "dynamic_sampling": False}})
    with pytest.raises(RecipeError, match=r"algorithm.screen_from"):
        parse_recipe({"model": "m", "algorithm": {"screen": 2, "screen_from": 1.5}})


def _first(task: PassRateTask, gid: int, prompt: Prompt, rewards: list[int]):
    """A group of `prompt` scored from answers right (1) or wrong (0)."""
    answers = [
        Completion(list(prompt.prompt_ids), [r], [-0.5], "stop", None, 0, 0) for r in rewards
    ]
    return build_group(task, prompt, answers, gid)


def test_probes_are_admitted_at_their_expected_pass_rate_and_one_with_no_place_is_stale():
    """A probe (a group on its first samples) counts as started only once it passes the screen;
    admission counts the pending ones at the recent pass rate. One that passes when no place is
    left within max_staleness of its version is dropped as stale, its tokens waste."""
    task = PassRateTask([0.5])
    pool = EnginePool([FakeEngine()], [64], monitor=False)
    signal = Signal(AlgorithmConfig(dynamic_sampling=True, screen=2), 1)
    screen = Screen(2, signal, min_screened=0)
    # one group a step, on-policy: one place at version 0
    pipeline = Pipeline(pool, 1, 0, GROUP, 64, keep=signal.carries, screen=screen, filter_limit=99)
    pipeline.grant(100)
    prompts = task.prompts(0)
    screen.seen(_first(task, -1, next(prompts), [0, 1]))  # a right and a wrong answer seen
    for _ in range(3):  # three probes screened out: the pass rate is now (0 + 1) / (3 + 1)
        prompt = next(prompts)
        gid, _ = pipeline.start(prompt, False)
        assert not pipeline.screened(gid, _first(task, gid, prompt, [1, 1]))
    assert pipeline.counts.screened == 3
    # counted whole, only one probe could start; at a pass rate of 1/4, four do
    started = [(p, pipeline.start(p, False)) for p in (next(prompts) for _ in range(5))]
    assert [s is not None for _, s in started] == [True] * 4 + [False]
    (p0, (g0, _)), (p1, (g1, _)) = started[:2]
    assert pipeline.screened(g0, _first(task, g0, p0, [0, 1]))  # passed: the one place
    late = _first(task, g1, p1, [1, 0])
    assert not pipeline.screened(g1, late)  # passed, with no place left for version 0
    for p, (gid, _) in started[2:4]:  # screened out: the trainer waits for a probe due now
        assert not pipeline.screened(gid, _first(task, gid, p, [1, 1]))
    whole = _first(task, g0, p0, [0, 1] * (GROUP // 2))
    pipeline.complete(g0, whole)
    batch = pipeline.take(1, version=0, stall_s=5)
    assert [g.id for g in batch.groups] == [g0]
    assert batch.stale_dropped == 1 and batch.dropped_tokens == late.tokens > 0


def _steps(task: PassRateTask, steps: int, batch: int = 4, max_inflight: int = 64):
    """`steps` batches taken from a real Producer and Pipeline under max_staleness 1 (the engine
    double serving the trainer's version after each step), with staged sampling (screen 2)."""
    engine = SeededEngine(task, delay=0.25)
    pool = EnginePool([engine], [max_inflight], monitor=False)
    signal = Signal(AlgorithmConfig(dynamic_sampling=True, screen=2), 1)
    pipeline = Pipeline(
        pool,
        batch,
        1,
        GROUP,
        max_inflight,
        keep=signal.carries,
        screen=Screen(2, signal),
        filter_limit=1000,
    )
    producer = Producer(pipeline, pool, task, SamplingParams(max_new_tokens=1), seed=0)
    pipeline.grant(batch * (steps + 2))  # the last steps' groups do not drain the pipeline
    producer.start()
    batches = []
    try:
        for version in range(steps):
            batches.append(pipeline.take(batch, version=version, stall_s=60))
            engine.version = version + 1
            pool.serves(pool.members[0], version + 1)
    finally:
        producer.stop()
    return batches, engine, pipeline


def test_when_most_probes_are_screened_out_more_run_at_once_within_the_staleness_bound():
    """At a pass rate of 0.95 nine probes in ten are screened out. Counted whole, the probes of the
    (K + 1) * B = 8 groups admission allows kept a median 15 requests in flight here; counted at
    their pass rate they fill `max_inflight`, and every group trained is within max_staleness. (The
    engine double answers after 0.25 s, as a decode of a batch takes: answered faster than the
    producer's thread reads the answers, it would see fewer in flight than the pipeline counts.)"""
    batches, engine, pipeline = _steps(PassRateTask([0.95]), steps=8)
    assert pipeline.counts.screened > 0  # past the first verdicts, groups start as probes
    assert all(g.staleness(v) <= 1 for v, b in enumerate(batches) for g in b.groups)
    assert all(len(b.groups) == 4 for b in batches)
    rows = sorted(engine.rows)
    median = rows[len(rows) // 2]
    judged = pipeline.counts.screened + sum(1 for n in engine.requests.values() if n > 2)
    dropped = sum(b.stale_dropped for b in batches)
    print(
        f"\nrows in flight: median {median}, most {engine.most_in_flight}; {judged} probes judged, "
        f"{pipeline.counts.screened} screened out, {dropped} passed with no place"
    )
    assert median >= 40 and engine.most_in_flight <= 64
    # a probe that passes after the places its version fits are taken is dropped: a few of them
    assert dropped <= 0.25 * (judged - pipeline.counts.screened)


def test_groups_start_whole_while_few_would_be_screened_out():
    """Staged sampling pays once half the groups are screened out (`algorithm.screen_from`): at a
    pass rate of 0.5 a group's first two answers are both right a quarter of the time, so groups
    keep starting whole, and what a probe would have found is still counted."""
    _, engine, pipeline = _batches(PassRateTask([0.5]), screen=2, groups=40, min_screened=0.5)
    assert pipeline.counts.screened == 0
    assert sum(n == GROUP for n in engine.requests.values()) >= len(engine.requests) - 3
    verdicts = list(pipeline._verdicts)
    assert len(verdicts) >= 40 and 0.1 < 1 - sum(verdicts) / len(verdicts) < 0.4


def test_an_older_probe_that_passes_late_goes_ahead_of_a_newer_group_with_room_to_spare():
    """One group a step, on-policy (K = 0): probe A starts at version 0, the engine flips, probe B
    starts at version 1 and passes first. A passing next still fits: trained oldest first, A at
    step 0 and B at step 1, each within the bound."""
    task = PassRateTask([0.5])
    pool = EnginePool([FakeEngine()], [64], monitor=False)
    signal = Signal(AlgorithmConfig(dynamic_sampling=True, screen=2), 1)
    screen = Screen(2, signal, min_screened=0)
    pipeline = Pipeline(pool, 1, 0, GROUP, 64, keep=signal.carries, screen=screen, filter_limit=99)
    pipeline.grant(10)
    prompts = task.prompts(0)
    screen.seen(_first(task, -1, next(prompts), [0, 1]))
    for _ in range(3):  # three screened out: the pass rate (0 + 1) / (3 + 1) lets B start
        prompt = next(prompts)
        gid, _ = pipeline.start(prompt, False)
        assert not pipeline.screened(gid, _first(task, gid, prompt, [1, 1]))
    pa = next(prompts)
    a, _ = pipeline.start(pa, False)
    pool.serves(pool.members[0], 1)
    pb = next(prompts)
    b, group_b = pipeline.start(pb, False)
    assert group_b.version == 1
    assert pipeline.screened(b, _first(task, b, pb, [0, 1]))
    assert pipeline.screened(a, _first(task, a, pa, [1, 0]))  # placed ahead of B
    for gid, prompt, version in ((b, pb, 1), (a, pa, 0)):
        answers = [
            Completion(list(prompt.prompt_ids), [i % 2], [-0.5], "stop", None, version, version)
            for i in range(GROUP)
        ]
        pipeline.complete(gid, build_group(task, prompt, answers, gid))
    first, second = pipeline.take(1, version=0, stall_s=5), pipeline.take(1, version=1, stall_s=5)
    assert [g.id for g in first.groups] == [a] and [g.id for g in second.groups] == [b]
    assert first.stale_dropped == second.stale_dropped == 0
