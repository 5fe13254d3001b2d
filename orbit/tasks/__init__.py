"""Tasks, chosen by the recipe's `task` section: built-ins or a user's `module:factory`."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from orbit.config import RecipeError, TaskConfig
from orbit.tasks.agent import AgentTask
from orbit.tasks.arith import ArithTask
from orbit.tasks.base import (
    FAILURE_MODES,
    MultiTurnTask,
    Prompt,
    Score,
    Segment,
    Task,
    TaskError,
    check_task,
    close_task,
    is_agent,
    is_multi_turn,
    task_stop_ids,
)
from orbit.tasks.common import DatasetError
from orbit.tasks.gym import GymTask
from orbit.tasks.jsonl import JsonlTask
from orbit.tasks.loader import TaskLoadError, resolve_factory
from orbit.tasks.math import MathTask
from orbit.tasks.pattern import PatternTask
from orbit.tasks.verifiers import VerifiersTask
from orbit.tasks.zorplex import ZorplexTask

__all__ = [
    "FAILURE_MODES",
    "MultiTurnTask",
    "Prompt",
    "Score",
    "Segment",
    "Task",
    "TaskError",
    "close_task",
    "is_agent",
    "is_multi_turn",
    "make_task",
    "task_stop_ids",
]

# Each built-in task by its own name; the names and their options are orbit/config/task.py's
# (BUILTINS).
BUILTINS: dict[str, type] = {
    task.name: task
    for task in (
        PatternTask,
        ArithTask,
        ZorplexTask,
        JsonlTask,
        MathTask,
        AgentTask,
        GymTask,
        VerifiersTask,
    )
}


def make_task(cfg: TaskConfig, tokenizer: PreTrainedTokenizerBase) -> Task:
    """Build the task a recipe names. Anything wrong with it is a RecipeError, before any
    compute."""
    options = cfg.options()
    where = f"task.name: {cfg.name!r}"
    try:
        if cfg.name in BUILTINS:
            task = BUILTINS[cfg.name](tokenizer, **options)
        else:
            factory = resolve_factory(cfg.name)
            try:
                task = factory(tokenizer, **options)
            # the user's factory failed: say so, with its message
            except Exception as err:  # noqa: BLE001
                raise RecipeError(
                    f"{where}: the factory raised {type(err).__name__}: {err}"
                ) from err
    except TaskLoadError as err:
        raise RecipeError(f"task.{'entry' if cfg.name == 'agent' else 'name'}: {err}") from None
    except DatasetError as err:
        field = {"agent": "data", "verifiers": "taskset"}.get(cfg.name, "path")
        raise RecipeError(f"task.{field}: {err}") from None
    except ValueError as err:
        if isinstance(err, RecipeError):
            raise
        raise RecipeError(str(err) if str(err).startswith("task.") else f"{where}: {err}") from None
    try:
        check_task(task, where)
    except TypeError as err:
        raise RecipeError(str(err)) from None
    return task
