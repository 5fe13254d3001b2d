"""Pieces the built-in tasks share: prompt encoding, held-out splits, answer-tag scoring."""

from __future__ import annotations

import zlib

from transformers import PreTrainedTokenizerBase

from orbit.tasks.base import Prompt, Score, Segment, answer_tag

CORRECT_REWARD = 1.0
FORMAT_REWARD = 0.2  # an answer tag is present, right or wrong
FREE_TOOL_CALLS = 2
TOOL_CALL_PENALTY = 0.1  # per tool call beyond FREE_TOOL_CALLS
EVAL_EVERY = 5  # one problem in EVAL_EVERY (by a stable hash) is held out for evaluation


def check_chat(tokenizer: PreTrainedTokenizerBase, chat: bool) -> bool:
    """`chat` as given, after checking that the tokenizer has a chat template to apply."""
    if chat and not getattr(tokenizer, "chat_template", None):
        raise ValueError("task.chat: true, but this model's tokenizer has no chat template")
    return chat


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str, chat: bool) -> tuple[int, ...]:
    """Token ids of a prompt; `chat`: as the user turn of the tokenizer's chat template."""
    if check_chat(tokenizer, chat):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
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


def answer_score(text: str, answer: str, tool_calls: int = 0, spam: bool = False, **info) -> Score:
    """Shaped reward: +1.0 correct, +0.2 answer tag present, -0.1 per tool call beyond 2.

    failure_mode: success | tool_spam (`spam`: more tool calls than the problem needs, and wrong)
    | wrong_format (no answer tag) | wrong_answer.
    """
    given = answer_tag(text)
    format_ok = given is not None
    correct = format_ok and given == answer.strip()
    reward = CORRECT_REWARD * correct + FORMAT_REWARD * format_ok
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
        info={"correct": bool(correct), "format_ok": format_ok, "failure_mode": mode, "tool_calls": tool_calls,
              "given": given, **info},
    )


class AnswerTagTask:
    """Single-turn tasks scored by the `<answer>` tag; needs `tokenizer` and `stop_token_ids`."""

    tokenizer: PreTrainedTokenizerBase
    stop_token_ids: tuple[int, ...]

    def score(self, prompt: Prompt, output_ids: list[int]) -> Score:
        return answer_score(decode(self.tokenizer, output_ids), prompt.answer)

    def demonstration(self, prompt: Prompt) -> list[Segment]:
        """The correct completion, for the warm start's supervised pass."""
        ids = self.tokenizer.encode(f"<answer>{prompt.answer}</answer>", add_special_tokens=False)
        if not self.stop_token_ids:
            ids.append(self.tokenizer.eos_token_id)
        return [Segment(tuple(ids), True)]
