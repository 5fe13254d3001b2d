"""`jsonl`: a dataset of `{"prompt": ..., "answer": ...}` rows, scored by the answer tag.

The model is rewarded for `<answer>ANSWER</answer>` with exactly the row's answer (after
stripping whitespace): +1.0 correct, +0.2 answer tag present. Held out for evaluation: the rows
of `eval_path` if given, else every `holdout_every`-th row of `path` (which training then skips).
Rows are checked when the task is built (and at recipe load): a bad row names its line number.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from orbit.tasks.base import Prompt
from orbit.tasks.common import (
    AnswerTagTask,
    DatasetError,
    check_chat,
    encode_prompt,
    shuffled_rows,
    single_token,
)


@dataclass(frozen=True)
class Row:
    line: int
    prompt: str
    answer: str


def load_rows(path: str | Path) -> list[Row]:
    """Every row of a JSONL file, validated. Blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path} line {line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DatasetError(f"{where}: not valid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise DatasetError(
                    f"{where}: a row must be an object with 'prompt' and 'answer', got "
                    f"{type(row).__name__}"
                )
            missing = [k for k in ("prompt", "answer") if k not in row]
            if missing:
                raise DatasetError(f"{where}: missing {' and '.join(repr(k) for k in missing)}")
            prompt, answer = row["prompt"], row["answer"]
            if not isinstance(prompt, str) or not prompt.strip():
                raise DatasetError(f"{where}: 'prompt' must be a non-empty string, got {prompt!r}")
            if isinstance(answer, bool) or not isinstance(answer, str | int | float):
                raise DatasetError(
                    f"{where}: 'answer' must be a string or a number, got {answer!r}"
                )
            answer = str(answer).strip()
            if not answer:
                raise DatasetError(f"{where}: 'answer' is empty")
            rows.append(Row(line_no, prompt, answer))
    if not rows:
        raise DatasetError(f"{path}: no rows")
    return rows


class JsonlTask(AnswerTagTask):
    name = "jsonl"

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        path: str | Path,
        eval_path: str | Path | None = None,
        holdout_every: int = 10,
        template: str | None = None,
        chat: bool = False,
    ) -> None:
        if holdout_every < 2:
            raise ValueError(f"task.holdout_every: must be >= 2, got {holdout_every}")
        self.tokenizer = tokenizer
        self.template = template or "{prompt}"
        if "{prompt}" not in self.template:
            raise ValueError(f"task.template: {self.template!r} lacks {{prompt}}")
        self.chat = check_chat(tokenizer, chat)
        rows = load_rows(path)
        if eval_path is not None:
            self.rows = {"train": rows, "eval": load_rows(eval_path)}
        else:
            self.rows = {
                "train": [r for i, r in enumerate(rows, 1) if i % holdout_every],
                "eval": [r for i, r in enumerate(rows, 1) if not i % holdout_every],
            }
        if not self.rows["train"]:
            raise DatasetError(
                f"{path}: no training rows left after holding out every {holdout_every}th row"
            )
        end = single_token(tokenizer, "</answer>")
        self.stop_token_ids: tuple[int, ...] = (end,) if end is not None else ()

    def prompts(self, seed: int, split: str = "train") -> Iterator[Prompt]:
        for n, row in shuffled_rows(self.rows, split, f"jsonl-{split}-{seed}"):
            text = self.template.format(prompt=row.prompt)
            yield Prompt(
                id=f"jsonl-{split}-L{row.line}-{n}",
                text=text,
                prompt_ids=encode_prompt(self.tokenizer, text, self.chat),
                answer=row.answer,
            )
