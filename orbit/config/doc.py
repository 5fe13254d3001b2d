"""docs/recipe.md, written from the recipe's schema: every section, field, default and description,
so the page cannot say anything the code does not (`make docs` writes it; tests/test_docs.py fails
when it is stale)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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


def _default(field: FieldInfo, given: Any = None) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True, validated_data={})
    if given is not None:
        value = given
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


def _table(
    model: type[BaseModel],
    prefix: str,
    skip: tuple[str, ...] = (),
    defaults: BaseModel | None = None,
) -> list[str]:
    """One row per field; `defaults`: the section as a recipe that leaves it out gets it (the
    algorithm's preset filled in), where that differs from the field's own default."""
    rows = ["| field | type | default | what |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        what = (field.description or "").replace("\n", " ").replace("|", "\\|")
        given = getattr(defaults, name) if defaults is not None else None
        rows.append(f"| `{prefix}{name}` | {_type(field)} | {_default(field, given)} | {what} |")
    return rows


def render() -> str:
    out = [HEAD, "## Top level", ""]
    sections: dict[str, type[BaseModel]] = {}
    for n, f in Recipe.model_fields.items():
        kind = f.annotation
        if n != "task" and isinstance(kind, type) and issubclass(kind, BaseModel):
            sections[n] = kind
    out += _table(Recipe, "", skip=(*sections, "task"))
    for name, section in sections.items():
        out += ["", f"## `{name}:`", ""]
        if name == "algorithm":
            given = Recipe.model_fields[name].get_default(call_default_factory=True)
            out += [
                f"A recipe that names no `preset` gets `{given.preset}`'s settings: the defaults "
                "below. `preset: orbit_v1` gives Orbit's default before it (each field's own "
                "default: `advantage: grpo`, `token-mean`, `ratio: truncate`, no filters).",
                "",
            ]
            out += _table(section, f"{name}.", defaults=given)
            out += ["", "### `algorithm.mask:`", ""] + _table(MaskBand, "algorithm.mask.")
        else:
            out += _table(section, f"{name}.")
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
