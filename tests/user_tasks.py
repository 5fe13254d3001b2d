"""User tasks loaded by import path in the tests (`tests/user_tasks.py:factory`)."""

from __future__ import annotations

import random

from orbit.tasks.base import Prompt, Score
from orbit.tasks.zorplex import ZorplexTask


class CountWord:
    """A user's own single-turn task: reward = fraction of generated tokens that are `word`'s
    tokens."""

    name = "count-word"

    def __init__(self, tokenizer, word: str = "yes") -> None:
        self.tokenizer = tokenizer
        self.word_ids = set(tokenizer.encode(" " + word, add_special_tokens=False))
        self.word = word

    def prompts(self, seed: int, split: str = "train"):
        rng = random.Random(f"{split}-{seed}")
        n = 0
        while True:
            text = f"{self.word} " * rng.randint(1, 4)
            yield Prompt(
                f"count-{split}-{n}",
                text,
                tuple(self.tokenizer.encode(text, add_special_tokens=False)),
            )
            n += 1

    def score(self, prompt: Prompt, output_ids: list[int]) -> Score:
        hits = sum(t in self.word_ids for t in output_ids)
        reward = hits / max(1, len(output_ids))
        return Score(
            reward,
            {
                "correct": reward > 0.5,
                "format_ok": True,
                "failure_mode": "success" if reward > 0.5 else "wrong_answer",
            },
        )


def count_word(tokenizer, word: str = "yes") -> CountWord:
    return CountWord(tokenizer, word)


def not_a_task(tokenizer):
    return 42


def factory_raises(tokenizer):
    raise ValueError("this factory needs an API key")


class BrokenLookup(ZorplexTask):
    """zorplex whose LOOKUP service goes down after `fail_after` calls."""

    def __init__(self, tokenizer, fail_after: int = 100) -> None:
        super().__init__(tokenizer)
        self.fail_after = fail_after
        self.calls = 0

    def lookup(self, prompt: Prompt, key: str) -> str:
        self.calls += 1
        if self.calls > self.fail_after:
            raise ConnectionError("lookup service unavailable (HTTP 503)")
        return super().lookup(prompt, key)


def broken_zorplex(tokenizer, fail_after: int = 100) -> BrokenLookup:
    return BrokenLookup(tokenizer, fail_after)


class NoSplit(CountWord):
    """prompts(seed) only: a task with no held-out split."""

    def prompts(self, seed: int):  # noqa: D102 - deliberately without `split`
        return super().prompts(seed)


def no_split(tokenizer) -> NoSplit:
    return NoSplit(tokenizer)


class EvalSplitBug(CountWord):
    """Has an eval split, whose prompt code has a bug (a TypeError of its own)."""

    def prompts(self, seed: int, split: str = "train"):
        if split == "eval":
            return iter([None + 1])  # the bug: TypeError
        return super().prompts(seed, split)


def eval_split_bug(tokenizer) -> EvalSplitBug:
    return EvalSplitBug(tokenizer)


class BrokenScorer(CountWord):
    """Its verifier fails after `fail_after` scores."""

    def __init__(self, tokenizer, fail_after: int = 10) -> None:
        super().__init__(tokenizer)
        self.fail_after, self.calls = fail_after, 0

    def score(self, prompt: Prompt, output_ids: list[int]) -> Score:
        self.calls += 1
        if self.calls > self.fail_after:
            raise RuntimeError("verifier crashed")
        return super().score(prompt, output_ids)


def broken_scorer(tokenizer, fail_after: int = 10) -> BrokenScorer:
    return BrokenScorer(tokenizer, fail_after)


class NanReward(CountWord):
    """A reward function with a bug: NaN after `fail_after` scores (the loss, then the gradient, is
    NaN)."""

    def __init__(self, tokenizer, fail_after: int = 10) -> None:
        super().__init__(tokenizer)
        self.fail_after, self.calls = fail_after, 0

    def score(self, prompt: Prompt, output_ids: list[int]) -> Score:
        self.calls += 1
        score = super().score(prompt, output_ids)
        return Score(float("nan"), score.info) if self.calls > self.fail_after else score


def nan_reward(tokenizer, fail_after: int = 10) -> NanReward:
    return NanReward(tokenizer, fail_after)


class SlowScorer(CountWord):
    """A task whose verifier takes `delay_s` per sample (a slow sandbox, say)."""

    def __init__(self, tokenizer, delay_s: float = 0.1) -> None:
        super().__init__(tokenizer)
        self.delay_s = delay_s

    def score(self, prompt: Prompt, output_ids: list[int]) -> Score:
        import time

        time.sleep(self.delay_s)
        return super().score(prompt, output_ids)


def slow_scorer(tokenizer, delay_s: float = 0.1) -> SlowScorer:
    return SlowScorer(tokenizer, delay_s)
