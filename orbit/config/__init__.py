"""What a recipe can say: its schema and YAML loading (recipe.py), each task's own options
(task.py), the five loop modes (modes.py), and docs/recipe.md written from the schema (doc.py)."""

from orbit.config.recipe import (
    AdapterConfig,
    EngineConfig,
    Recipe,
    RecipeError,
    RolloutConfig,
    TrainerConfig,
    dump_recipe,
    load_recipe,
    parse_recipe,
    set_dotted,
)
from orbit.config.task import TaskConfig

__all__ = [
    "AdapterConfig",
    "EngineConfig",
    "Recipe",
    "RecipeError",
    "RolloutConfig",
    "TaskConfig",
    "TrainerConfig",
    "dump_recipe",
    "load_recipe",
    "parse_recipe",
    "set_dotted",
]
