"""`agent`: plain agent code written against the `openai` client, as a task.

    task: {name: agent, entry: agents/retry.py:solve, data: data/questions.jsonl}

`entry` names `async def FUNCTION(client, model, example)`: `client` is an `openai.AsyncOpenAI`
bound to one episode (its base URL names the episode on Orbit's endpoint, orbit/agents/), `model`
the name to pass, and `example` one row of `data` (a .jsonl, .json, .parquet or .csv file, or a
`save_to_disk` directory, read through `datasets`). It returns the episode's reward, a `float`, or
`(reward, info)` with `info` a dict of its own figures. Every token the model generated in the
episode is trained; what came from the prompt, a tool or the user is context.

An episode is a success when its reward reaches `success` (1.0); that is what `orbit eval` calls
accuracy (a `correct` in `info` overrides it). Held out for `orbit eval`: the rows of `eval_data`,
else every `holdout_every`-th row of `data` (which training then skips).
"""

from __future__ import annotations

import inspect
import json
import math
import random
from collections.abc import Iterator

from orbit.tasks.base import Prompt, Score, TaskError
from orbit.tasks.common import DatasetError
from orbit.tasks.loader import resolve_factory
from orbit.tasks.math import load_dataset_rows


class AgentTask:
    """Rows of a dataset, each run through the user's agent function. `run` is what the rollout
    calls."""

    name = "agent"
    agent = True  # the rollout runs `run` for each episode instead of generating itself

    def __init__(
        self,
        tokenizer,
        entry: str,
        data: str,
        eval_data: str | None = None,
        holdout_every: int = 10,
        success: float = 1.0,
    ) -> None:
        self.tokenizer = tokenizer
        self.entry, self.success = entry, success
        self.function = resolve_factory(entry)
        if not inspect.iscoroutinefunction(self.function):
            raise ValueError(
                f"task.entry: {entry!r} must be an `async def FUNCTION(client, model, example)`"
            )
        rows = _rows(data)
        if eval_data is not None:
            self.train, self.eval = rows, _rows(eval_data)
        else:
            self.train, self.eval = held_out(rows, holdout_every, data)

    def prompts(self, seed: int, split: str = "train") -> Iterator[Prompt]:
        """The split's rows, shuffled by `seed`, again and again (each pass in a new order)."""
        rows = self.train if split == "train" else self.eval
        rng = random.Random(seed)
        order = list(range(len(rows)))
        # the held-out rows in the file's order: every evaluation sees the same ones
        if split == "eval":
            while True:
                for i in order:
                    yield self._prompt(rows[i], i, split)
        while True:
            rng.shuffle(order)
            for i in order:
                yield self._prompt(rows[i], i, split)

    def _prompt(self, row: dict, i: int, split: str) -> Prompt:
        text = json.dumps(row, sort_keys=True, default=str)
        return Prompt(
            id=f"agent-{split}-{i}",
            text=text,
            prompt_ids=(),
            answer=str(row.get("answer", "")),
            meta={"example": row},
        )

    async def run(self, client, model: str, prompt: Prompt) -> Score:
        """One episode: the agent function on the prompt's row. What it returns, checked."""
        result = await self.function(client, model, dict(prompt.meta["example"]))
        reward, info = result if isinstance(result, tuple) and len(result) == 2 else (result, {})
        return episode_score(reward, info, f"the agent {self.entry}", self.success)

    def score(self, prompt: Prompt, output_ids: list[int]) -> Score:
        raise TaskError(
            "an agent task's reward is what its agent returns: its episodes are run, not scored"
        )


def episode_score(reward: object, info: object, who: str, success: float) -> Score:
    """An episode's reward and figures, checked: a success when the reward reaches `success` (a
    `correct` in `info` overrides it)."""
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise TaskError(
            f"{who} returned {type(reward).__name__} {reward!r}; it must return a float reward, or "
            "(reward, info)"
        )
    if not math.isfinite(reward):
        raise TaskError(f"{who} returned a non-finite reward ({reward})")
    if not isinstance(info, dict):
        raise TaskError(f"{who} returned info of type {type(info).__name__}; info is a dict")
    correct = bool(info.get("correct", reward >= success))
    return Score(
        float(reward),
        {**info, "correct": correct, "failure_mode": "success" if correct else "wrong_answer"},
    )


def held_out(rows: list, every: int, source: str) -> tuple[list, list]:
    """(training rows, held-out rows): every `every`-th row held out."""
    train = [r for i, r in enumerate(rows) if i % every != every - 1]
    held = [r for i, r in enumerate(rows) if i % every == every - 1]
    if not train or not held:
        raise DatasetError(
            f"{source}: {len(rows)} row(s) leave no {'training' if not train else 'held-out'} rows "
            f"(holdout_every {every}; or give eval_data)"
        )
    return train, held


def _rows(path: str) -> list[dict]:
    data = load_dataset_rows(path)
    rows = [dict(r) for r in data]
    if not rows:
        raise DatasetError(f"{path}: no rows")
    return rows
