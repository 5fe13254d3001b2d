"""The recipe's `task:` section: each built-in task declares its own options (a model per task,
chosen by `task.name`), and a user task `module:factory` takes whatever its factory takes.

An option a built-in task does not have fails at load naming the field and listing the task's
options. Options left unset take the task's defaults. `TaskConfig(name=..., **options)` builds the
right model from anywhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    SerializerFunctionWrapHandler,
    Tag,
    TypeAdapter,
    field_validator,
    model_serializer,
    model_validator,
)


class TaskConfig(BaseModel):
    """A task's options. Called on this base class, it builds the model `name` chooses."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    name: str = Field(
        "pattern",
        min_length=1,
        description="a built-in task (BUILTINS below) or your own, 'module:factory'",
    )

    def __new__(cls, *args: Any, **data: Any) -> Any:
        # the model for this name, validated (its own __init__ then runs again: idempotent)
        if cls is TaskConfig:
            return TASK_ADAPTER.validate_python(data)
        return super().__new__(cls)

    @property
    def is_builtin(self) -> bool:
        return self.name in BUILTIN_TASKS

    def options(self) -> dict[str, Any]:
        """The keyword arguments of the task's constructor or factory: every option that is set."""
        fields = {k: getattr(self, k) for k in type(self).model_fields if k != "name"}
        extra = dict(self.model_extra or {})
        return {k: v for k, v in {**fields, **extra}.items() if v is not None}

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None or k == "name"}

    @field_validator("*", mode="before")
    @classmethod
    def _paths_as_text(cls, value: object) -> object:
        # a Path from Python; a hub name is text
        return str(value) if isinstance(value, Path) else value


_TEMPLATE = Field(None, min_length=1, description="prompt text with the task's {placeholders}")
_CHAT = Field(None, description="wrap the prompt in the tokenizer's chat template (false)")
_SYSTEM = Field(None, description="a system prompt (with chat: true)")
_HOLDOUT = Field(None, ge=2, description="hold out every Nth row for evaluation (10)")


class PatternTaskConfig(TaskConfig):
    name: Literal["pattern"] = "pattern"
    target: str | None = Field(None, min_length=1, description="the word to emit (yes)")


class ArithTaskConfig(TaskConfig):
    name: Literal["arith"]
    max_digits: int | None = Field(
        None, ge=1, le=9, description="operands have 1..max_digits digits (2)"
    )
    ops: str | None = Field(None, pattern=r"^[+*-]+$", description="operators to draw from (+-)")
    template: str | None = _TEMPLATE
    chat: bool | None = _CHAT
    system: str | None = _SYSTEM
    answer: Literal["tag", "math"] | None = Field(
        None,
        description="how the answer is read: the <answer> tag, "
        "exactly (tag); or math-verify, by value (math)",
    )


class ZorplexTaskConfig(TaskConfig):
    name: Literal["zorplex"]
    min_hops: int | None = Field(None, ge=1, le=25, description="shortest lookup chain (1)")
    max_hops: int | None = Field(None, ge=1, le=25, description="longest lookup chain (3)")
    max_turns: int | None = Field(
        None, ge=1, le=64, description="model turns per episode (max_hops + 3)"
    )
    template: str | None = _TEMPLATE
    result_format: str | None = Field(
        None, min_length=1, description="an injected tool result ({value})"
    )
    call_format: str | None = Field(None, min_length=1, description="a tool call (LOOKUP({key}))")
    call_end: str | None = Field(
        None, min_length=1, description="one-token end of a call; stops the turn"
    )
    chat: bool | None = _CHAT
    answer: Literal["tag", "math"] | None = Field(None, description="how the answer is read (tag)")

    @model_validator(mode="after")
    def _hops(self) -> ZorplexTaskConfig:
        if (
            self.min_hops is not None
            and self.max_hops is not None
            and self.min_hops > self.max_hops
        ):
            raise ValueError(
                f"task.min_hops: {self.min_hops} is more than max_hops {self.max_hops}"
            )
        return self


class JsonlTaskConfig(TaskConfig):
    name: Literal["jsonl"]
    path: str = Field(..., min_length=1, description="rows of {prompt, answer}")
    eval_path: str | None = Field(
        None, min_length=1, description="held-out rows (default: every holdout_every-th)"
    )
    holdout_every: int | None = _HOLDOUT
    template: str | None = _TEMPLATE
    chat: bool | None = _CHAT


class MathTaskConfig(TaskConfig):
    name: Literal["math"]
    path: str = Field(
        ...,
        min_length=1,
        description="a dataset file (jsonl, json, parquet, csv), a save_to_disk "
        "directory or a hub dataset name",
    )
    eval_path: str | None = Field(
        None, min_length=1, description="held-out rows (default: every holdout_every-th)"
    )
    holdout_every: int | None = _HOLDOUT
    question_field: str | None = Field(
        None, min_length=1, description="the question's field (question)"
    )
    answer_field: str | None = Field(
        None,
        min_length=1,
        description="the answer's field (answer; a GSM8K answer's "
        "value is what follows its last ####)",
    )
    template: str | None = _TEMPLATE
    chat: bool | None = _CHAT
    system: str | None = _SYSTEM
    format_reward: float | None = Field(
        None,
        ge=0.0,
        le=10.0,
        description="reward for giving any answer math-verify can read, right or wrong (0)",
    )


class AgentTaskConfig(TaskConfig):
    name: Literal["agent"]
    entry: str = Field(
        ...,
        pattern=r"^[^:]+:[A-Za-z_][A-Za-z0-9_]*$",
        description="FILE.py:FUNCTION or "
        "module:FUNCTION, an `async def FUNCTION(client, model, example)`",
    )
    data: str = Field(..., min_length=1, description="the examples, a dataset file or directory")
    eval_data: str | None = Field(
        None,
        min_length=1,
        description="held-out examples (default: every holdout_every-th row of data)",
    )
    holdout_every: int | None = _HOLDOUT
    success: float | None = Field(
        None, description="the reward at which an episode counts as a success (1)"
    )


class GymTaskConfig(TaskConfig):
    name: Literal["reasoning-gym"]
    dataset: str = Field(
        ...,
        min_length=1,
        description="the dataset's name (e.g. chain_sum; composite mixes several)",
    )
    config: dict[str, Any] | None = Field(None, description="the dataset's own options")
    answer: Literal["tag", "final"] | None = Field(
        None, description="the <answer> tag (tag), or the final boxed value, number or line (final)"
    )
    template: str | None = _TEMPLATE
    chat: bool | None = _CHAT
    system: str | None = _SYSTEM
    eval_size: int | None = Field(None, ge=1, le=100_000, description="held-out problems (200)")
    partial_credit: bool | None = Field(
        None,
        description="the dataset's score as the reward, not 1 for correct and 0 otherwise (false)",
    )


class VerifiersTaskConfig(TaskConfig):
    name: Literal["verifiers"]
    taskset: str = Field(
        ...,
        min_length=1,
        description="a verifiers taskset: its importable id, or a FILE.py that defines it",
    )
    python: str = Field(
        ...,
        min_length=1,
        description="the Python of the virtualenv verifiers is installed in "
        "(make verifiers: .venv-verifiers/bin/python)",
    )
    harness: str | None = Field(
        None,
        min_length=1,
        description="a verifiers harness id (default: one chat turn, made in-process)",
    )
    holdout_every: int | None = _HOLDOUT
    success: float | None = Field(
        None, description="the reward at which an episode counts as a success (1)"
    )


class UserTaskConfig(TaskConfig):
    """`name` is `module:factory` (or `file.py:factory`), called as `factory(tokenizer, **options)`
    with every other key set here."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    @field_validator("name")
    @classmethod
    def _importable(cls, name: str) -> str:
        if ":" not in name:
            raise ValueError(
                f"unknown task {name!r} (built-in: {', '.join(BUILTIN_TASKS)}; or your own as "
                "'module:factory' or 'file.py:factory')"
            )
        return name


BUILTINS: dict[str, type[TaskConfig]] = {
    "pattern": PatternTaskConfig,
    "arith": ArithTaskConfig,
    "zorplex": ZorplexTaskConfig,
    "jsonl": JsonlTaskConfig,
    "math": MathTaskConfig,
    "agent": AgentTaskConfig,
    "reasoning-gym": GymTaskConfig,
    "verifiers": VerifiersTaskConfig,
}
BUILTIN_TASKS = tuple(BUILTINS)


def _kind(value: Any) -> str:
    name = (
        value.get("name", "pattern")
        if isinstance(value, dict)
        else getattr(value, "name", "pattern")
    )
    return name if name in BUILTINS else "user"


# The recipe's `task:` section: the model its name chooses (pydantic's tagged union, built from
# BUILTINS, the one list of built-in tasks); type checkers see the base class.
if TYPE_CHECKING:
    TaskSection = TaskConfig
else:
    TaskSection = Annotated[
        Union[  # noqa: UP007 - a union built from a tuple at run time
            tuple(Annotated[model, Tag(name)] for name, model in BUILTINS.items())
            + (Annotated[UserTaskConfig, Tag("user")],)
        ],
        Discriminator(_kind),
    ]
TASK_ADAPTER: TypeAdapter[TaskConfig] = TypeAdapter(TaskSection)
