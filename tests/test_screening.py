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
    """Answers each request on a thread of its own, right with its prompt's pass rate; records the
    requests per prompt and the most ever in flight."""

    def __init__(self, task: PassRateTask) -> None:
        super().__init__()
        self.task = task
        self.requests: Counter[tuple[int, ...]] = Counter()
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()

    def generate(self, prompt_ids, sampling: SamplingParams, slot="active", meta=None) -> Future:
        rate = self.task.rates[(prompt_ids[1] - 10 + 1000 * prompt_ids[2]) % len(self.task.rates)]
        right = int(random.Random(sampling.seed).random() < rate)
        with self.lock:
            self.requests[tuple(prompt_ids)] += 1
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        fut: Future = Future()

        def answer() -> None:
            with self.lock:
                self.in_flight -= 1
            fut.set_result(Completion(list(prompt_ids), [right], [-0.5], "stop", None, 0, 0))

        threading.Timer(0.001, answer).start()
        return fut


def _batches(task: PassRateTask, screen: int | None, groups: int, max_inflight: int = 24):
    """`groups` groups that carried signal, from a real Producer and Pipeline; with the engine and
    pipeline, to read what it took."""
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
        screen=Screen(screen, signal) if screen else None,
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
