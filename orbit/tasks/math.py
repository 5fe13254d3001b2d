"""`math`: problems from a dataset, answered in the model's own words, checked with math-verify.

The data loads through the `datasets` library from `task.path`: a .jsonl, .json, .parquet or .csv
file, a directory written by `save_to_disk`, or (on a machine that reaches the hub) a hub dataset
name. A file shaped like GSM8K (`question`, and an `answer` that ends in `#### N`) works as it is;
other field names are mapped with `question_field` and `answer_field`. The gold answer is what
follows the last `####`, or the whole answer field; every row's must be a value math-verify can
read, checked when the task is built (at recipe load), naming the file and row.

A completion is right when math-verify reads an answer from it (the last `\\boxed{}`, a `#### N`, or
the final number) equal in value to the gold one: +1.0, plus `format_reward` whenever it reads any
answer at all. Failure modes as the other tasks: success, wrong_format (no answer found),
wrong_answer. Held out for evaluation: the rows of `eval_path` if given, else every
`holdout_every`-th row of `path` (which training then skips).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from orbit.tasks.base import Prompt, Score
from orbit.tasks.common import (
    DatasetError,
    answer_score,
    check_chat,
    decode,
    encode_prompt,
    shuffled_rows,
)
from orbit.tasks.verify import MathChecker

FILE_KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass(frozen=True)
class Problem:
    row: int  # 1-based, in the file's order
    question: str
    answer: str  # the gold answer


def gold_answer(answer: str) -> str:
    """GSM8K's answers reason first and end in `#### N`: the gold answer is N."""
    return answer.rsplit("####", 1)[-1].strip()


def load_dataset_rows(path: str | Path, split: str = "train"):
    """The rows of a dataset file, a `save_to_disk` directory, or a hub dataset, through
    `datasets`."""
    import datasets

    p = Path(path)
    datasets.utils.logging.disable_progress_bar()
    try:
        if p.is_dir():
            data = datasets.load_from_disk(str(p))
            if isinstance(data, datasets.DatasetDict):
                if split not in data:
                    raise DatasetError(f"{p}: has splits {sorted(data)}, not {split!r}")
                data = data[split]
            return data
        if p.is_file():
            if p.suffix not in FILE_KINDS:
                raise DatasetError(
                    f"{p}: a {p.suffix or 'suffix-less'} file; datasets load "
                    f"{', '.join(FILE_KINDS)}"
                )
            return datasets.load_dataset(FILE_KINDS[p.suffix], data_files=str(p), split="train")
        if p.suffix in FILE_KINDS or str(path).startswith((".", "/")):
            raise DatasetError(f"{p}: no such file")
        return datasets.load_dataset(str(path), split=split)  # a hub dataset name
    except DatasetError:
        raise
    except Exception as err:  # noqa: BLE001 - datasets' own reason, in one line
        raise DatasetError(
            f"{p}: datasets cannot load it ({type(err).__name__}: {str(err).splitlines()[0]})"
        ) from None


def load_problems(
    path: str | Path,
    question_field: str,
    answer_field: str,
    checker: MathChecker,
    split: str = "train",
) -> list[Problem]:
    """Every row as a problem, validated: both fields present and non-empty, the gold answer
    readable."""
    data = load_dataset_rows(path, split)
    missing = [f for f in (question_field, answer_field) if f not in data.column_names]
    if missing:
        raise DatasetError(
            f"{path}: no {' or '.join(repr(f) for f in missing)} field (its fields: "
            f"{', '.join(data.column_names)}; map yours with task.question_field / "
            "task.answer_field)"
        )
    problems = []
    for i, row in enumerate(data, start=1):
        question, answer = row[question_field], row[answer_field]
        for field, value in ((question_field, question), (answer_field, answer)):
            if value is None or not str(value).strip():
                raise DatasetError(f"{path} row {i}: {field!r} is empty")
        problems.append(Problem(i, str(question), gold_answer(str(answer))))
    if not problems:
        raise DatasetError(f"{path}: no rows")
    bad = checker.unreadable([p.answer for p in problems])
    if bad:
        p = problems[bad[0]]
        raise DatasetError(
            f"{path} row {p.row}: the answer {p.answer!r} is not a value math-verify can read"
            + (f" ({len(bad)} such rows)" if len(bad) > 1 else "")
        )
    return problems


class MathTask:
    name = "math"

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        path: str | Path,
        eval_path: str | Path | None = None,
        holdout_every: int = 10,
        question_field: str = "question",
        answer_field: str = "answer",
        template: str | None = None,
        chat: bool = False,
        system: str | None = None,
        format_reward: float = 0.0,
    ) -> None:
        if holdout_every < 2:
            raise ValueError(f"task.holdout_every: must be >= 2, got {holdout_every}")
        self.tokenizer = tokenizer
        self.template = template or "{question}"
        if "{question}" not in self.template:
            raise ValueError(f"task.template: {self.template!r} lacks {{question}}")
        self.chat, self.system, self.format_reward = (
            check_chat(tokenizer, chat),
            system,
            format_reward,
        )
        # The model's own end of turn ends its answer (eos, which the engine stops at): no stop of
        # its own.
        self.stop_token_ids: tuple[int, ...] = ()
        self.checker = MathChecker()
        try:
            rows = load_problems(path, question_field, answer_field, self.checker)
            self.rows = (
                {
                    "train": rows,
                    "eval": load_problems(eval_path, question_field, answer_field, self.checker),
                }
                if eval_path is not None
                else {
                    "train": [r for i, r in enumerate(rows, 1) if i % holdout_every],
                    "eval": [r for i, r in enumerate(rows, 1) if not i % holdout_every],
                }
            )
        except BaseException:
            self.checker.close()
            raise
        # checks `system`
        encode_prompt(tokenizer, self.template.format(question="1 + 1"), self.chat, self.system)

    def prompts(self, seed: int, split: str = "train") -> Iterator[Prompt]:
        for n, row in shuffled_rows(self.rows, split, f"math-{split}-{seed}"):
            text = self.template.format(question=row.question)
            ids = encode_prompt(self.tokenizer, text, self.chat, self.system)
            yield Prompt(
                id=f"math-{split}-R{row.row}-{n}", text=text, prompt_ids=ids, answer=row.answer
            )

    def score(self, prompt: Prompt, output_ids: list[int]) -> Score:
        return answer_score(
            decode(self.tokenizer, output_ids),
            prompt.answer,
            checker=self.checker,
            format_reward=self.format_reward,
        )

    def close(self) -> None:
        self.checker.close()
