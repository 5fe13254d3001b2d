"""docs/recipe.md, written from the recipe's schema: every section, field, default and description,
so the page cannot say anything the code does not (`make docs` writes it; tests/test_docs.py fails
when it is stale)."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from orbit.config import Recipe
from orbit.config.task import BUILTINS, UserTaskConfig
from orbit.rl import MaskBand

HEAD = """# Recipe reference

Every field of a recipe, its default and what it does: generated from the schema
(`orbit/config/recipe.py`, `orbit/rl/config.py`, `orbit/config/task.py`) by `make docs`; a test
fails when this page is stale. How the pieces fit: [recipes and algorithms](recipes.md),
[algorithms](algorithms.md), [tasks and agents](agents.md).
A recipe that breaks any of this fails at load, before any compute, naming the field.
"""


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True, validated_data={})
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, Path):
        value = str(value)
    return "`" + json.dumps(value) + "`" if value is not None else "unset"


def _type(field: FieldInfo) -> str:
    text = str(field.annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")
    for prefix in ("orbit.rl.config.", "orbit.config.", "orbit.config.task.", "pathlib.", "orbit."):
        text = text.replace(prefix, "")
    return text.replace("NoneType", "None").replace("|", "\\|")


def _table(model: type[BaseModel], prefix: str, skip: tuple[str, ...] = ()) -> list[str]:
    rows = ["| field | type | default | what |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        what = (field.description or "").replace("\n", " ").replace("|", "\\|")
        rows.append(f"| `{prefix}{name}` | {_type(field)} | {_default(field)} | {what} |")
    return rows


def render() -> str:
    out = [HEAD, "## Top level", ""]
    sections: dict[str, type[BaseModel]] = {}
    for n, f in Recipe.model_fields.items():
        make = f.default_factory
        if n != "task" and isinstance(make, type) and issubclass(make, BaseModel):
            sections[n] = make
    out += _table(Recipe, "", skip=(*sections, "task"))
    for name, section in sections.items():
        out += ["", f"## `{name}:`", ""] + _table(section, f"{name}.")
        if name == "algorithm":
            out += ["", "### `algorithm.mask:`", ""] + _table(MaskBand, "algorithm.mask.")
    out += [
        "",
        "## `task:`",
        "",
        "Each built-in task has its own options; an option it does not have fails at load, naming "
        "it. Options left unset take the task's defaults.",
        "",
    ]
    for task, model in BUILTINS.items():
        out += [f"### `task: {{name: {task}}}`", ""] + _table(model, "task.", skip=("name",)) + [""]
    out += [
        "### `task: {name: module:factory}`",
        "",
        (UserTaskConfig.__doc__ or "").strip().replace("\n    ", " "),
        "",
    ]
    return "\n".join(out).rstrip() + "\n"


def write(path: Path = Path("docs/recipe.md")) -> Path:
    path.write_text(render())
    return path


if __name__ == "__main__":
    print(f"wrote {write()}")
