"""The docs say what the code does: the recipe reference is the schema's, the table of how a run
ends is orbit/run/ends.py's, and every command the docs show runs as written
(scripts/docs_check.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from orbit.config import doc as recipe_doc
from orbit.run import ends

ROOT = Path(__file__).resolve().parent.parent


def test_the_recipe_reference_is_the_schemas():
    assert (ROOT / "docs" / "recipe.md").read_text() == recipe_doc.render(), (
        "docs/recipe.md is stale: `make docs` writes it from the schema"
    )


def test_the_table_of_how_a_run_ends_is_the_codes():
    assert ends.table() in (ROOT / "docs" / "operations.md").read_text(), (
        "docs/operations.md's table of how a run ends differs from orbit/run/ends.py's"
    )
    assert {e.code for e in ends.ENDS} == {0, 1, 2, 3, 130}


def test_every_command_in_the_docs_runs_as_written():
    spec = importlib.util.spec_from_file_location("docs_check", ROOT / "scripts" / "docs_check.py")
    docs_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(docs_check)
    problems = docs_check.problems()
    assert not problems, "\n".join(problems)
