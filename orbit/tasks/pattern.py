"""A verifiable task a tiny random model can learn in minutes: emit the target word.

The reward is dense on purpose: the fraction of generated tokens that are tokens of the target
word. A random model scores near 1/vocab; a trained policy learns to repeat the target, so
rewards rise within a few dozen steps on a CPU.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from transformers import PreTrainedTokenizerBase

from orbit.tasks.base import Prompt, Score

_WORDS = (
    "red blue green cat dog sun moon star tree one two three four five up down left right".split()
)


class PatternTask:
    name = "pattern"

    def __init__(self, tokenizer: PreTrainedTokenizerBase, target: str = "yes") -> None:
        if not target:
            raise ValueError("task.target: must be a non-empty word")
        self.tokenizer = tokenizer
        self.target = target
        self.target_ids = set(tokenizer.encode(" " + target, add_special_tokens=False))
        self.target_ids |= set(tokenizer.encode(target, add_special_tokens=False))
        self.eos_id = tokenizer.eos_token_id

    def prompts(self, seed: int, split: str = "train") -> Iterator[Prompt]:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        # The train stream is the original one; eval prompts come from a stream of their own.
        rng = random.Random(seed if split == "train" else f"pattern-eval-{seed}")
        prefix = "pattern" if split == "train" else "pattern-eval"
        n = 0
        while True:
            words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 6)))
            text = f"say {self.target}: {words}"
            ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
            yield Prompt(id=f"{prefix}-{seed}-{n}", text=text, prompt_ids=ids, answer=self.target)
            n += 1

    def score(self, prompt: Prompt, output_ids: list[int]) -> Score:
        tokens = [t for t in output_ids if t != self.eos_id]
        hits = sum(t in self.target_ids for t in tokens)
        reward = hits / max(len(tokens), 1)
        correct = reward >= 0.5
        return Score(
            reward=reward,
            info={
                "correct": correct,
                "format_ok": True,
                "hits": hits,
                "failure_mode": "success" if correct else "wrong_answer",
            },
        )
