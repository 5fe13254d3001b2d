"""The recipe's `task:` section: a built-in task and its options, or a user task `module:factory`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


BUILTIN_TASKS = ("pattern", "arith", "zorplex", "jsonl", "math", "agent", "reasoning-gym")
# The options each built-in task takes; every other option must stay unset (null) for it.
TASK_OPTIONS = {
    "pattern": ("target",),
    "arith": ("max_digits", "ops", "template", "chat", "system", "answer"),
    "zorplex": ("min_hops", "max_hops", "max_turns", "template", "result_format", "call_format", "call_end", "chat",
                "answer"),
    "jsonl": ("path", "eval_path", "holdout_every", "template", "chat"),
    "math": ("path", "eval_path", "holdout_every", "question_field", "answer_field", "template", "chat", "system",
             "format_reward"),
    "agent": ("entry", "data", "eval_data", "holdout_every", "success"),
    "reasoning-gym": ("dataset", "config", "answer", "template", "chat", "system", "eval_size", "partial_credit"),
}


class TaskConfig(_Section):
    """`name` is a built-in task or a user task `module:factory` (or `file.py:factory`), called as
    `factory(tokenizer, **options)` with the options set here (extra keys included). Options left
    unset (null) take the task's defaults."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    name: str = Field("pattern", min_length=1, description="pattern | arith | zorplex | jsonl | math | agent | "
                      "reasoning-gym | module:factory")
    target: str | None = Field(None, min_length=1, description="pattern: the word to emit (default yes)")
    max_digits: int | None = Field(None, ge=1, le=9, description="arith: operands have 1..max_digits digits (2)")
    ops: str | None = Field(None, pattern=r"^[+*-]+$", description="arith: operators to draw from (+-)")
    min_hops: int | None = Field(None, ge=1, le=25, description="zorplex: shortest lookup chain (1)")
    max_hops: int | None = Field(None, ge=1, le=25, description="zorplex: longest lookup chain (3)")
    max_turns: int | None = Field(None, ge=1, le=64, description="zorplex: model turns per episode (max_hops + 3)")
    template: str | None = Field(None, min_length=1, description="prompt text with the task's {placeholders}")
    result_format: str | None = Field(None, min_length=1, description="zorplex: injected tool result ({value})")
    call_format: str | None = Field(None, min_length=1, description="zorplex: a tool call (LOOKUP({key}))")
    call_end: str | None = Field(None, min_length=1, description="zorplex: one-token end of a call; stops the turn")
    chat: bool | None = Field(None, description="wrap the prompt in the tokenizer's chat template (false)")
    system: str | None = Field(None, description="arith, math: a system prompt (with chat: true)")
    answer: Literal["tag", "math", "final"] | None = Field(
        None, description="arith, zorplex: how the answer is read: the <answer> tag, exactly (tag); or math-verify, by "
        "value (math); reasoning-gym: the <answer> tag (tag), or the final boxed value, number or line (final)")
    path: str | None = Field(None, min_length=1, description="jsonl: rows of {prompt, answer}; math: a dataset "
                             "file (jsonl, json, parquet, csv), a save_to_disk directory or a hub dataset name")
    eval_path: str | None = Field(None, min_length=1, description="jsonl, math: held-out rows (default: every "
                                  "holdout_every-th row)")
    holdout_every: int | None = Field(None, ge=2, description="jsonl, math: hold out every Nth row of path (10)")

    @field_validator("path", "eval_path", "data", "eval_data", mode="before")
    @classmethod
    def _path_as_text(cls, value: object) -> object:
        return str(value) if isinstance(value, Path) else value  # a Path from Python; a hub name is text
    question_field: str | None = Field(None, min_length=1, description="math: the question's field (question)")
    answer_field: str | None = Field(None, min_length=1, description="math: the answer's field (answer; a "
                                     "GSM8K answer's value is what follows its last ####)")
    format_reward: float | None = Field(None, ge=0.0, le=10.0, description="math: reward for giving any answer "
                                        "math-verify can read, right or wrong (0)")
    entry: str | None = Field(None, pattern=r"^[^:]+:[A-Za-z_][A-Za-z0-9_]*$", description="agent: FILE.py:FUNCTION "
                              "or module:FUNCTION, an `async def FUNCTION(client, model, example)`")
    data: str | None = Field(None, min_length=1, description="agent: the examples, a dataset file or directory")
    eval_data: str | None = Field(None, min_length=1, description="agent: held-out examples (default: every "
                                  "holdout_every-th row of data)")
    success: float | None = Field(None, description="agent: the reward at which an episode counts as a success (1)")
    dataset: str | None = Field(None, min_length=1, description="reasoning-gym: the dataset's name (e.g. chain_sum; "
                                "composite mixes several)")
    config: dict[str, Any] | None = Field(None, description="reasoning-gym: the dataset's own options")
    eval_size: int | None = Field(None, ge=1, le=100_000, description="reasoning-gym: held-out problems (200)")
    partial_credit: bool | None = Field(None, description="reasoning-gym: the dataset's score as the reward, not 1 "
                                        "for correct and 0 otherwise (false)")

    @property
    def is_builtin(self) -> bool:
        return self.name in BUILTIN_TASKS

    def options(self) -> dict[str, Any]:
        """The keyword arguments of the task's constructor or factory: every option that is set."""
        fields = {k: getattr(self, k) for k in type(self).model_fields if k != "name"}
        extra = dict(self.model_extra or {})
        return {k: v for k, v in {**fields, **extra}.items() if v is not None}

    @model_validator(mode="after")
    def _known(self) -> TaskConfig:
        if self.is_builtin:
            allowed = TASK_OPTIONS[self.name]
            extra = sorted(self.model_extra or {})
            if extra:
                raise ValueError(f"task.{extra[0]}: unknown key for task {self.name!r} (its options: "
                                 f"{', '.join(allowed)})")
            wrong = [k for k in self.options() if k not in allowed]
            if wrong:
                raise ValueError(f"task.{wrong[0]}: not an option of task {self.name!r} (its options: "
                                 f"{', '.join(allowed)})")
            if self.name == "jsonl" and self.path is None:
                raise ValueError("task.path: required for task 'jsonl' (a JSONL file of {prompt, answer} rows)")
            if self.name == "math" and self.path is None:
                raise ValueError("task.path: required for task 'math' (a dataset file or directory of problems)")
            if self.name == "reasoning-gym" and self.dataset is None:
                raise ValueError("task.dataset: required for task 'reasoning-gym' (e.g. dataset: chain_sum)")
            for field in ("entry", "data"):
                if self.name == "agent" and getattr(self, field) is None:
                    raise ValueError(f"task.{field}: required for task 'agent' (entry: FILE.py:FUNCTION, data: FILE)")
            if self.min_hops is not None and self.max_hops is not None and self.min_hops > self.max_hops:
                raise ValueError(f"task.min_hops: {self.min_hops} is more than max_hops {self.max_hops}")
        elif ":" not in self.name:
            raise ValueError(f"task.name: unknown task {self.name!r} (built-in: {', '.join(BUILTIN_TASKS)}; "
                             "or your own as 'module:factory' or 'file.py:factory')")
        return self

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None or k == "name"}
