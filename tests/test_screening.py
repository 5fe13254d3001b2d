"""Staged sampling (`algorithm.screen`): a new prompt is probed with a few samples first, and its
group is generated unless all of those reached the best reward seen. Unit tests of the producer and
pipeline over an engine double that answers from the request's seed (one piece: the real engine
runs it in tests/test_train_modes.py, and the laptop recipe in bench/learning.py)."""

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
from orbit.rollout.groups import Screen, Signal
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
    pass rate, with the weights of `version`; records the requests and seeds per prompt, the most
    ever in flight, and how many were in flight as each arrived."""

    def __init__(self, task: PassRateTask, delay: float = 0.001) -> None:
        super().__init__()
        self.task, self.delay, self.version = task, delay, 0
        self.requests: Counter[tuple[int, ...]] = Counter()
        self.seeds: dict[tuple[int, ...], list[int]] = {}
        self.in_flight = self.most_in_flight = 0
        self.rows: list[int] = []
        self.lock = threading.Lock()

    def generate(self, prompt_ids, sampling: SamplingParams, slot="active", meta=None) -> Future:
        rate = self.task.rates[(prompt_ids[1] - 10 + 1000 * prompt_ids[2]) % len(self.task.rates)]
        right = int(random.Random(sampling.seed).random() < rate)
        with self.lock:
            self.requests[tuple(prompt_ids)] += 1
            self.seeds.setdefault(tuple(prompt_ids), []).append(sampling.seed)
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


def _run(
    task: PassRateTask,
    screen: int | None,
    batch: int,
    steps: int = 1,
    max_staleness: int | None = None,
    max_inflight: int = 24,
    min_screened: float = 0.0,
    delay: float = 0.001,
    spare: int = 0,
):
    """`steps` batches of `batch` groups that carried signal, taken from a real Producer and
    Pipeline (the engine double serving the trainer's version after each step); with the engine
    and pipeline, to read what it took. Probes run from the first prompt with `min_screened` 0;
    `spare` batches more are granted, so the last steps' groups do not drain the pipeline."""
    engine = SeededEngine(task, delay)
    pool = EnginePool([engine], [max_inflight], monitor=False)
    signal = Signal(AlgorithmConfig(dynamic_sampling=True, screen=screen), 1)
    pipeline = Pipeline(
        pool,
        batch,
        max_staleness,
        GROUP,
        max_inflight,
        keep=signal.carries,
        screen=Screen(screen, signal, min_screened) if screen else None,
        filter_limit=1000,
    )
    producer = Producer(pipeline, pool, task, SamplingParams(max_new_tokens=1), seed=0)
    pipeline.grant(batch * (steps + spare))
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


def _batches(
    task: PassRateTask,
    screen: int | None,
    groups: int,
    max_inflight: int = 24,
    min_screened: float = 0.0,
):
    """One batch of `groups` groups, unbounded staleness (`_run`)."""
    batches, engine, pipeline = _run(
        task, screen, groups, max_inflight=max_inflight, min_screened=min_screened
    )
    return batches[0], engine, pipeline


def test_a_prompt_whose_probe_is_all_right_is_dropped_before_its_group_is_generated():
    # prompts 0, 3, 6... always right, 1, 4, 7... always wrong, the others right half the time
    batch, engine, pipeline = _batches(PassRateTask([1.0, 0.0, 0.5]), screen=2, groups=6)
    per_prompt = {ids[1] - 10: n for ids, n in engine.requests.items()}
    # once a right and a wrong answer were seen, a solved prompt stops at its probe's two samples
    solved = [per_prompt[i] for i in sorted(per_prompt) if i % 3 == 0]
    assert solved[-3:] == [2, 2, 2] and max(solved) <= 2 + GROUP
    # a prompt always failed is never screened: its probe passes and its whole group is generated
    # (then dropped by dynamic sampling, complete); the last ones may still wait for their group
    failed = [per_prompt[i] for i in sorted(per_prompt) if i % 3 == 1]
    assert all(n in (2, 2 + GROUP) for n in failed) and failed.count(2 + GROUP) >= 3
    trained = {int(g.prompt.id) for g in batch.groups}
    assert all(i % 3 == 2 and per_prompt[i] == 2 + GROUP for i in trained)
    assert all(len(g.samples) == GROUP for g in batch.groups)
    assert all(len({s.reward for s in g.samples}) == 2 for g in batch.groups)
    # the group is a fresh draw: no sample of it replays one of its probe's
    assert all(len(set(seeds)) == len(seeds) for seeds in engine.seeds.values())
    c = pipeline.counts
    assert 0 < c.screened < c.filtered  # the failed groups are filtered whole, not screened
    assert engine.most_in_flight <= 24  # probes and groups share max_inflight


def test_without_screen_every_sample_of_a_group_is_generated():
    batch, engine, pipeline = _batches(PassRateTask([1.0, 0.0, 0.5]), screen=None, groups=6)
    assert set(engine.requests.values()) == {GROUP}
    assert pipeline.counts.screened == 0 and pipeline.counts.filtered >= 6


@pytest.mark.parametrize("rate", [0.9, 0.5])
def test_a_prompt_is_screened_out_with_the_chance_its_first_samples_are_all_right(rate):
    """The bias docs/algorithms.md states: with a right answer worth the best reward, staged
    sampling drops a prompt of pass rate p at its first k samples with probability p^k, so it
    trains it with probability (1 - p^k)(1 - p^n - (1-p)^n) where dynamic sampling alone does with
    1 - p^n - (1-p)^n. The seeds are fixed, so the share is the same on every run."""
    k, groups = 2, 200
    _, engine, pipeline = _batches(PassRateTask([rate]), screen=k, groups=groups, max_inflight=64)
    assert pipeline.probes is not None
    # every prompt was probed: screened out, or passed (its group started, or waiting to)
    went_on = sum(n > k for n in engine.requests.values())
    judged = pipeline.counts.screened + went_on + len(pipeline.probes.passed)
    share = pipeline.counts.screened / judged
    assert went_on >= groups and abs(share - rate**k) < 0.04, (share, judged)


def test_screen_is_checked_against_the_group_and_dynamic_sampling():
    with pytest.raises(RecipeError, match=r"algorithm.screen \(8\).*rollout.group_size \(8\)"):
        parse_recipe({"model": "m", "algorithm": {"screen": 8}, "rollout": {"group_size": 8}})
    with pytest.raises(RecipeError, match="algorithm.screen: .*dynamic_sampling is off"):
        parse_recipe({"model": "m", "algorithm": {"screen": 2, "dynamic_sampling": False}})
    with pytest.raises(RecipeError, match=r"algorithm.screen_from"):
        parse_recipe({"model": "m", "algorithm": {"screen": 2, "screen_from": 1.5}})
    with pytest.raises(RecipeError, match=r"algorithm.screen: .*mode 'sync' is serial"):
        parse_recipe({"model": "m", "algorithm": {"screen": 2}, "mode": "sync"})


def test_prompts_start_as_groups_while_few_would_be_screened_out():
    """Probes pay once half the prompts are screened out (`algorithm.screen_from`): at a pass rate
    of 0.5 a prompt's first two answers are both right a quarter of the time, so every prompt
    starts as a group, and what a probe would have found is still counted."""
    _, engine, pipeline = _batches(PassRateTask([0.5]), screen=2, groups=40, min_screened=0.5)
    assert pipeline.counts.screened == 0
    assert set(engine.requests.values()) == {GROUP}
    assert pipeline.probes is not None
    verdicts = pipeline.probes.verdicts
    assert len(verdicts) >= 40 and 0.1 < 1 - sum(verdicts) / len(verdicts) < 0.4


def test_probes_run_beside_the_groups_and_every_group_is_fresh_enough():
    """At a pass rate of 0.95 nine prompts in ten are screened out. Probes stand outside
    admission: they fill the rows the window's groups leave, every group trained is within
    max_staleness, and none is dropped as stale. (The engine double answers after 0.25 s, as a
    decode of a batch takes: answered faster than the producer's thread reads the answers, it
    would see fewer in flight than the pipeline counts.)"""
    # max_staleness 1, screen 2 from half screened out
    batches, engine, pipeline = _run(
        PassRateTask([0.95]),
        2,
        4,
        steps=8,
        max_staleness=1,
        max_inflight=64,
        min_screened=0.5,
        delay=0.25,
        spare=2,
    )
    assert pipeline.counts.screened > 0  # past the first verdicts, prompts start as probes
    assert all(len(b.groups) == 4 for b in batches)
    assert all(g.staleness(v) <= 1 for v, b in enumerate(batches) for g in b.groups)
    assert sum(b.stale_dropped for b in batches) == 0
    rows = sorted(engine.rows)
    print(
        f"\nrows in flight: median {rows[len(rows) // 2]}, most {engine.most_in_flight}; "
        f"{pipeline.counts.screened} screened out"
    )
    # counted as whole groups inside the window, probes left a median of 15 in flight here
    assert rows[len(rows) // 2] >= 24 and engine.most_in_flight <= 64


def test_no_probe_starts_without_a_grant_left():
    """At the end of a run (no grant left) a probe's prompt could never start its group: none
    starts, until a grant comes."""
    task = PassRateTask([0.5])
    pool = EnginePool([FakeEngine()], [64], monitor=False)
    signal = Signal(AlgorithmConfig(dynamic_sampling=True, screen=2), 1)
    pipeline = Pipeline(
        pool, 1, 1, GROUP, 64, keep=signal.carries, screen=Screen(2, signal), filter_limit=99
    )
    prompts = task.prompts(0)
    assert pipeline.start(next(prompts), False) is None
    pipeline.grant(1)
    gid, probe = pipeline.start(next(prompts), False)
    assert probe.probe and len(probe.completions) == 2
