"""Built-in tasks, chosen by the recipe's `task` section."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from orbit.config import TaskConfig
from orbit.tasks.base import Prompt, Score, Task
from orbit.tasks.pattern import PatternTask

__all__ = ["Prompt", "Score", "Task", "make_task"]


def make_task(cfg: TaskConfig, tokenizer: PreTrainedTokenizerBase) -> Task:
    if cfg.name == "pattern":
        return PatternTask(tokenizer, target=cfg.target)
    raise ValueError(f"task.name: unknown task {cfg.name!r}")
