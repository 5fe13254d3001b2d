"""`arith`: multi-digit arithmetic, answered in an answer tag (or, `answer: math`, in the model's
own words).

A prompt is `a OP b` written with the task's template (the tiny model's default: `12+34=`); the
model answers `<answer>46</answer>`, or with `answer: math` anything math-verify reads the value 46
from. Operands have 1..max_digits digits (each length equally likely); subtraction keeps a >= b.
One problem in five, by a stable hash of the problem, is held out: the train split never yields it,
the eval split yields only those.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from transformers import PreTrainedTokenizerBase

from orbit.tasks.base import Prompt
from orbit.tasks.common import (
    AnswerTagTask,
    answer_checker,
    check_chat,
    encode_prompt,
    in_split,
    single_token,
)

DEFAULT_TEMPLATE = "{a}{op}{b}="
OPS = "+-*"


class ArithTask(AnswerTagTask):
    name = "arith"

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        max_digits: int = 2,
        ops: str = "+-",
        template: str | None = None,
        chat: bool = False,
        system: str | None = None,
        answer: str = "tag",
    ) -> None:
        if max_digits < 1:
            raise ValueError(f"task.max_digits: must be >= 1, got {max_digits}")
        if not ops or any(o not in OPS for o in ops):
            raise ValueError(f"task.ops: {ops!r} must be a non-empty string of {list(OPS)}")
        self.tokenizer = tokenizer
        self.max_digits = max_digits
        self.ops = ops
        self.template = template or DEFAULT_TEMPLATE
        for key in ("{a}", "{b}"):
            if key not in self.template:
                raise ValueError(f"task.template: {self.template!r} lacks {key}")
        self.chat, self.system = check_chat(tokenizer, chat), system
        encode_prompt(tokenizer, "1", self.chat, system)  # a system prompt needs chat
        end = single_token(tokenizer, "</answer>")
        # Stop right after the answer tag when the tokenizer has it as one token.
        self.stop_token_ids: tuple[int, ...] = (end,) if end is not None and answer == "tag" else ()
        # last: nothing above may fail with its process started
        self.checker = answer_checker(answer)

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(1, self.max_digits)
        return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)

    def problem(self, rng: random.Random) -> tuple[int, str, int]:
        a, b, op = self._operand(rng), self._operand(rng), rng.choice(self.ops)
        if op == "-" and a < b:
            a, b = b, a
        return a, op, b

    def prompts(self, seed: int, split: str = "train") -> Iterator[Prompt]:
        rng = random.Random(f"arith-{split}-{seed}")
        n = 0
        while True:
            a, op, b = self.problem(rng)
            if not in_split(f"{a}{op}{b}", split):
                continue
            text = self.template.format(a=a, op=op, b=b)
            ids = encode_prompt(self.tokenizer, text, self.chat, self.system)
            answer = str(a + b if op == "+" else a - b if op == "-" else a * b)
            yield Prompt(id=f"arith-{split}-{seed}-{n}", text=text, prompt_ids=ids, answer=answer)
            n += 1
