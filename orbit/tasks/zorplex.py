"""`zorplex`: compositional lookups through a LOOKUP tool, over several turns.

Every prompt comes with its own hidden table from letters to letters or numbers. The question is
the zorplex value of a start key: look it up, and while the result is another key, look that up
too, until a number comes back; answer it in an answer tag. The table is random per prompt, so
the tool is the only way to the answer. With the tiny model's default format an episode reads

    zorplex(c)?  LOOKUP(c) ={q;}  LOOKUP(q) ={47;}  <answer>47</answer>

where the model writes the calls and the answer, and the tool's results (braced here) are
injected into the context and masked out of the loss. A model turn ends at the call's end marker
(`call_end`, default ")", which must be one token: it is a stop token of every turn); for a chat
model, e.g. `call_format: "<tool_call>LOOKUP({key})</tool_call>"`, `call_end: "</tool_call>"`.

Scoring (orbit.tasks.common.answer_score): +1.0 correct, +0.2 answer tag present, -0.1 per tool
call beyond 2. Failure modes: success, tool_spam (wrong, after more calls than the chain has),
wrong_format (no answer tag), wrong_answer. Held-out: one chain in five, by a stable hash.
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Iterator

from transformers import PreTrainedTokenizerBase

from orbit.tasks.base import Prompt, Score, Segment
from orbit.tasks.common import (
    FORMAT_REWARD,
    answer_checker,
    answer_score,
    check_chat,
    decode,
    encode_prompt,
    in_split,
    single_token,
)

DEFAULT_TEMPLATE = "zorplex({key})?"
DEFAULT_RESULT = "={value};"
UNKNOWN = "?"
KEYS = string.ascii_lowercase
DEFAULT_CALL = "LOOKUP({key})"
_CALL = re.compile(r"LOOKUP\(")
_LAST_CALL = re.compile(r"LOOKUP\(\s*([^()\s]*)\s*\)?\s*$")


class ZorplexTask:
    name = "zorplex"

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        min_hops: int = 1,
        max_hops: int = 3,
        max_turns: int | None = None,
        template: str | None = None,
        result_format: str | None = None,
        call_format: str | None = None,
        call_end: str = ")",
        chat: bool = False,
        answer: str = "tag",
    ) -> None:
        if not 1 <= min_hops <= max_hops <= len(KEYS) - 1:
            raise ValueError(
                f"task.min_hops/max_hops: need 1 <= min_hops <= max_hops <= 25, got {min_hops}, "
                f"{max_hops}"
            )
        self.tokenizer = tokenizer
        self.min_hops, self.max_hops = min_hops, max_hops
        self.max_turns = max_turns if max_turns is not None else max_hops + 3
        if self.max_turns < max_hops + 1:
            raise ValueError(
                f"task.max_turns: {self.max_turns} turns cannot finish a {max_hops}-hop chain (it "
                f"needs {max_hops} calls and an answer: at least {max_hops + 1})"
            )
        self.template = template or DEFAULT_TEMPLATE
        if "{key}" not in self.template:
            raise ValueError(f"task.template: {self.template!r} lacks {{key}}")
        self.result_format = result_format or DEFAULT_RESULT
        if "{value}" not in self.result_format:
            raise ValueError(f"task.result_format: {self.result_format!r} lacks {{value}}")
        self.chat = check_chat(tokenizer, chat)
        end = single_token(tokenizer, call_end)
        if end is None:
            ids = tokenizer.encode(call_end, add_special_tokens=False)
            raise ValueError(
                f"task.call_end: {call_end!r} is {len(ids)} tokens {ids} for this tokenizer; the "
                "tool call's end marker must be exactly one token (it stops the model's turn)"
            )
        self.call_end, self.call_end_id = call_end, end
        self.call_format = call_format or DEFAULT_CALL
        if "{key}" not in self.call_format or not self.call_format.endswith(call_end):
            raise ValueError(
                f"task.call_format: {self.call_format!r} must contain {{key}} and end with "
                f"call_end {call_end!r}"
            )
        answer_end = single_token(tokenizer, "</answer>")
        self.stop_token_ids: tuple[int, ...] = (end,) + (
            (answer_end,) if answer_end is not None else ()
        )
        # last: nothing above may fail with its process started
        self.checker = answer_checker(answer)

    # ---- prompts -----------------------------------------------------------------------------

    def _chain(self, rng: random.Random) -> tuple[list[str], str]:
        hops = rng.randint(self.min_hops, self.max_hops)
        return rng.sample(KEYS, hops), str(rng.randint(10, 99))

    def _table(self, rng: random.Random, chain: list[str], value: str) -> dict[str, str]:
        """The chain, and every other key pointing at a random key or number (decoys)."""
        table = {
            k: (rng.choice(KEYS) if rng.random() < 0.5 else str(rng.randint(10, 99))) for k in KEYS
        }
        for k, nxt in zip(chain, chain[1:] + [value], strict=True):
            table[k] = nxt
        return table

    def prompts(self, seed: int, split: str = "train") -> Iterator[Prompt]:
        rng = random.Random(f"zorplex-{split}-{seed}")
        n = 0
        while True:
            chain, value = self._chain(rng)
            table = self._table(rng, chain, value)
            if not in_split(">".join(chain + [value]), split):
                continue
            text = self.template.format(key=chain[0])
            yield Prompt(
                id=f"zorplex-{split}-{seed}-{n}",
                text=text,
                prompt_ids=encode_prompt(self.tokenizer, text, self.chat),
                answer=value,
                meta={"table": table, "chain": chain},
            )
            n += 1

    # ---- the tool ----------------------------------------------------------------------------

    def lookup(self, prompt: Prompt, key: str) -> str:
        return prompt.meta["table"].get(key, UNKNOWN)

    def next_turn(self, prompt: Prompt, transcript_ids: list[int]) -> list[int] | None:
        """After a model turn: the tool's result if the turn ended in a call, else None (done)."""
        if not transcript_ids or transcript_ids[-1] != self.call_end_id:
            return None
        text = decode(self.tokenizer, transcript_ids[:-1])
        call = _LAST_CALL.search(text)
        # the end marker without a call before it: nothing to run, the episode is over
        if call is None:
            return None
        value = self.lookup(prompt, call.group(1))
        return self.tokenizer.encode(
            self.result_format.format(value=value), add_special_tokens=False
        )

    # ---- scoring -----------------------------------------------------------------------------

    def score(self, prompt: Prompt, output_ids: list[int]) -> Score:
        text = decode(self.tokenizer, output_ids)
        calls = len(_CALL.findall(text))
        hops = len(prompt.meta["chain"])
        return answer_score(
            text,
            prompt.answer,
            tool_calls=calls,
            spam=calls > hops,
            checker=self.checker,
            format_reward=FORMAT_REWARD if self.checker is None else 0.0,
            hops=hops,
        )

    def close(self) -> None:
        if self.checker is not None:
            self.checker.close()

    def demonstration(self, prompt: Prompt) -> list[Segment]:
        """The correct episode: one call per hop, the tool's results, the answer."""
        segments: list[Segment] = []
        transcript: list[int] = []
        for key in prompt.meta["chain"]:
            call = self.tokenizer.encode(self.call_format.format(key=key), add_special_tokens=False)
            result = self.next_turn(prompt, transcript + call)
            assert result is not None
            segments += [Segment(tuple(call), True), Segment(tuple(result), False)]
            transcript += call + result
        answer = self.tokenizer.encode(
            f"<answer>{prompt.answer}</answer>", add_special_tokens=False
        )
        if len(self.stop_token_ids) < 2:  # no single-token answer end: eos ends the episode
            answer.append(self.tokenizer.eos_token_id)
        segments.append(Segment(tuple(answer), True))
        return segments
