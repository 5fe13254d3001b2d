"""Pieces the built-in tasks share: prompt encoding, held-out splits, a dataset's prompt stream,
answer-tag scoring."""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterator
from typing import TypeVar

from transformers import PreTrainedTokenizerBase

from orbit.tasks.base import Prompt, Score, Segment, answer_tag
from orbit.tasks.verify import MathChecker

CORRECT_REWARD = 1.0
FORMAT_REWARD = 0.2  # an answer tag is present, right or wrong
FREE_TOOL_CALLS = 2
TOOL_CALL_PENALTY = 0.1  # per tool call beyond FREE_TOOL_CALLS
EVAL_EVERY = 5  # one problem in EVAL_EVERY (by a stable hash) is held out for evaluation
R = TypeVar("R")


class DatasetError(ValueError):
    """A dataset file that cannot be used; the message names the file and line."""


def shuffled_rows(rows: dict[str, list[R]], split: str, key: str) -> Iterator[tuple[int, R]]:
    """A dataset task's prompt stream: the rows of `split` ('train' or 'eval') in one shuffled pass
    after another, for ever, each with its running number. `key` seeds the order (task, split and
    seed)."""
    if split not in rows:
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if not rows[split]:
        raise DatasetError(
            "the dataset has no held-out rows: give task.eval_path, or more rows than "
            "task.holdout_every"
        )
    rng = random.Random(key)
    n = 0
    while True:
        order = list(range(len(rows[split])))
        rng.shuffle(order)
        for i in order:
            yield n, rows[split][i]
            n += 1


def check_chat(tokenizer: PreTrainedTokenizerBase, chat: bool) -> bool:
    """`chat` as given, after checking that the tokenizer has a chat template to apply."""
    if chat and not getattr(tokenizer, "chat_template", None):
        raise ValueError("task.chat: true, but this model's tokenizer has no chat template")
    return chat


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase, text: str, chat: bool, system: str | None = None
) -> tuple[int, ...]:
    """Token ids of a prompt; `chat`: as the user turn of the tokenizer's chat template, after
    `system` as the system turn when given (else the template's own default, if it has one)."""
    if system is not None and not chat:
        raise ValueError(
            "task.system: a system prompt needs task.chat: true (it is a turn of the chat template)"
        )
    if check_chat(tokenizer, chat):
        turns = [{"role": "system", "content": system}] if system is not None else []
        ids = tokenizer.apply_chat_template(
            turns + [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding
            ids = ids["input_ids"]
        return tuple(int(t) for t in ids)
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def single_token(tokenizer: PreTrainedTokenizerBase, text: str) -> int | None:
    """The id of `text` if the tokenizer writes it as exactly one token, else None."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def held_out(key: str) -> bool:
    """Whether a problem belongs to the eval split: a stable hash, the same on every machine."""
    return zlib.crc32(key.encode()) % EVAL_EVERY == 0


def in_split(key: str, split: str) -> bool:
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    return held_out(key) == (split == "eval")


def decode(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    """Text of generated ids: eos/pad dropped, task markup kept."""
    drop = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    return tokenizer.decode([t for t in ids if t not in drop], skip_special_tokens=False)


# how an answer is read: the answer tag, exactly; or math-verify, by value
ANSWERS = ("tag", "math")


def answer_score(
    text: str,
    answer: str,
    tool_calls: int = 0,
    spam: bool = False,
    checker: MathChecker | None = None,
    format_reward: float = FORMAT_REWARD,
    **info,
) -> Score:
    """Shaped reward: +1.0 correct, +`format_reward` (0.2) an answer was given, -0.1 per tool call
    beyond 2.

    The answer is read from the `<answer>` tag and must equal `answer` exactly; with a `checker`, it
    is read by math-verify (the last `\\boxed{}`, a `#### N` or the final number) and compared by
    value. failure_mode: success | tool_spam (`spam`: more tool calls than the problem needs, and
    wrong)
    | wrong_format (no answer found) | wrong_answer.
    """
    timed_out = False
    if checker is None:
        given = answer_tag(text)
        correct = given is not None and given == answer.strip()
    else:
        verdict = checker.check(text, answer)
        given, correct, timed_out = verdict.given, verdict.correct, verdict.timed_out
        if timed_out:
            info["timed_out"] = True
    format_ok = given is not None
    reward = CORRECT_REWARD * correct + format_reward * format_ok
    reward -= TOOL_CALL_PENALTY * max(0, tool_calls - FREE_TOOL_CALLS)
    if correct:
        mode = "success"
    elif spam:
        mode = "tool_spam"
    elif not format_ok:
        mode = "wrong_format"
    else:
        mode = "wrong_answer"
    return Score(
        reward=round(reward, 6),
        info={
            "correct": bool(correct),
            "format_ok": format_ok,
            "failure_mode": mode,
            "tool_calls": tool_calls,
            "given": given,
            **info,
        },
    )


def answer_checker(answer: str) -> MathChecker | None:
    """The checker a task's `answer` option asks for: None for the answer tag, math-verify for
    `math`."""
    if answer not in ANSWERS:
        raise ValueError(f"task.answer: {answer!r} is not one of {', '.join(ANSWERS)}")
    return MathChecker() if answer == "math" else None


class AnswerTagTask:
    """Single-turn tasks scored by the `<answer>` tag (or, `answer: math`, by math-verify); needs
    `tokenizer`, `stop_token_ids` and `checker`."""

    tokenizer: PreTrainedTokenizerBase
    stop_token_ids: tuple[int, ...]
    checker: MathChecker | None = None

    def score(self, prompt: Prompt, output_ids: list[int]) -> Score:
        # In its own words a model almost always gives some number: no reward for that alone.
        return answer_score(
            decode(self.tokenizer, output_ids),
            prompt.answer,
            checker=self.checker,
            format_reward=FORMAT_REWARD if self.checker is None else 0.0,
        )

    def close(self) -> None:
        """Stop what the task started (math-verify's process)."""
        if self.checker is not None:
            self.checker.close()

    def demonstration(self, prompt: Prompt) -> list[Segment]:
        """The correct completion, for the warm start's supervised pass."""
        ids = self.tokenizer.encode(f"<answer>{prompt.answer}</answer>", add_special_tokens=False)
        if not self.stop_token_ids:
            ids.append(self.tokenizer.eos_token_id)
        return [Segment(tuple(ids), True)]
