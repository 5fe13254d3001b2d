"""`make docs-check`: every command the docs show still runs as written.

From the README, CONTRIBUTING and docs/ (and bench/README.md and bench/investigations/), every line
of a code block that runs `orbit`, `make` or a bench script is checked against the code: an `orbit`
command and every option it uses must exist (parsed by the command line's own parser, without
running it), a recipe file it names must load (the schema; not its model), a `make` target must be
in the Makefile, and a bench script must exist and know the options it is shown with. A synopsis
line (`orbit train RECIPE [--mode M]`) is checked for its command and options only.
tests/test_docs.py runs it; a snippet that no longer runs is a failing test.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [
    "README.md",
    "CONTRIBUTING.md",
    "bench/README.md",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "bench" / "investigations").glob("*.md")),
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
]
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z0-9_]{1,}\b")


def commands(page: Path) -> list[tuple[int, str]]:
    """(line number, command) of every orbit / make / bench line in the page's code blocks."""
    out, inside, pending = [], False, ""
    for i, line in enumerate(page.read_text().splitlines(), start=1):
        if line.strip().startswith("```"):
            inside = not inside
            continue
        if not inside:
            continue
        text = (pending + " " + line.strip()) if pending else line.strip()
        if text.endswith("\\"):
            pending = text[:-1]
            continue
        pending = ""
        text = re.sub(r"\s+#.*$", "", text).strip()
        for prefix in (
            ".venv/bin/orbit ",
            "orbit ",
            "make ",
            ".venv/bin/python bench/",
            "python bench/",
        ):
            if text.startswith(prefix):
                out.append(
                    (
                        i,
                        text.removeprefix(".venv/bin/").removeprefix("python ")
                        if "bench/" in text
                        else text.removeprefix(".venv/bin/"),
                    )
                )
                break
    return out


def _options(words: list[str]) -> list[str]:
    return [w.split("=")[0] for w in words if w.startswith("--")]


def check_orbit(words: list[str]) -> str | None:
    import typer

    from orbit.cli import app

    group = typer.main.get_command(app)  # typer's own click: asked through what its commands have
    args = list(words[1:])
    ctx = group.make_context("orbit", ["--help"], resilient_parsing=True)
    synopsis = (
        any(c in " ".join(args) for c in "[|")
        or "..." in args
        or any(PLACEHOLDER.fullmatch(a) for a in args)
    )
    command, path = group, []
    while hasattr(command, "get_command") and args and not args[0].startswith("-"):
        name = args.pop(0)
        sub = command.get_command(ctx, name)
        if sub is None:
            return f"no command `orbit {' '.join([*path, name])}`"
        command, path = sub, [*path, name]
    known = {
        o for p in command.params for o in getattr(p, "opts", []) + getattr(p, "secondary_opts", [])
    }
    unknown = [o for o in _options(args) if o not in known]
    if unknown:
        return f"`orbit {' '.join(path)}` has no option {unknown[0]}"
    if not synopsis:
        try:
            command.make_context(f"orbit {' '.join(path)}", list(args), resilient_parsing=False)
        # click's usage error, whichever click typer carries
        except Exception as err:  # noqa: BLE001
            message = err.format_message() if hasattr(err, "format_message") else str(err)
            return f"`orbit {' '.join(path)}` refuses it: {message}"
    for word in args:
        if word.endswith((".yaml", ".yml")) and not PLACEHOLDER.search(word):
            problem = check_recipe(ROOT / word)
            if problem:
                return problem
    return None


def check_recipe(path: Path) -> str | None:
    import yaml

    from orbit.config import RecipeError, parse_recipe

    if not path.is_file():
        return f"no recipe file {path.relative_to(ROOT)}"
    data = yaml.safe_load(path.read_text())
    if isinstance(data, dict) and "runs" in data:
        return None  # a sweep's recipe: `orbit recipe check` and the sweep tests load those
    try:
        parse_recipe(data)
    except RecipeError as err:
        return f"{path.relative_to(ROOT)} does not load: {err}"
    return None


def check_make(words: list[str]) -> str | None:
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", (ROOT / "Makefile").read_text(), re.M))
    for word in words[1:]:
        if "=" in word or word.startswith("-"):
            continue
        if word not in targets:
            return f"no make target {word!r}"
    return None


def check_bench(words: list[str], usages: dict[str, tuple[int, str]]) -> str | None:
    script = ROOT / words[0]
    if not script.is_file():
        return f"no script {words[0]}"
    code, out = usages[words[0]]
    if code != 0:
        return f"{words[0]} --help fails: {out.strip().splitlines()[-1:]}"
    missing = [o for o in _options(words[1:]) if o not in out]
    return f"{words[0]} has no option {missing[0]}" if missing else None


# Each script's `--help` as `python SCRIPT --help` gives it (runpy runs it as __main__), all in one
# process: each on its own would import torch again (a core-second or more apiece).
_HELP = """
import contextlib, io, json, os, runpy, sys, traceback
out, path = {}, list(sys.path)
for script in sys.argv[1:]:
    text, code = io.StringIO(), 0
    sys.argv = [script, "--help"]
    sys.path[:] = [os.path.dirname(os.path.abspath(script)), *path]  # as `python SCRIPT` has it
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as end:
            code = end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
        except BaseException:
            code = 1
            traceback.print_exc()
    out[script] = (code, text.getvalue())
print(json.dumps(out))
"""


def _usages(scripts: list[str]) -> dict[str, tuple[int, str]]:
    """Each bench script's exit code and --help text."""
    found = [s for s in dict.fromkeys(scripts) if (ROOT / s).is_file()]
    if not found:
        return {}
    run = subprocess.run(
        [sys.executable, "-c", _HELP, *found],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    if run.returncode != 0:
        raise RuntimeError(f"the bench scripts' --help runner failed:\n{run.stderr[-2000:]}")
    return {k: tuple(v) for k, v in json.loads(run.stdout.strip().splitlines()[-1]).items()}


def problems() -> list[str]:
    lines = []
    for page in PAGES:
        path = ROOT / page
        if path.is_file():
            for line, text in commands(path):
                words = [w for w in shlex.split(text, posix=True) if w != "&&"]
                lines.append((page, line, text, words))
    usages = _usages([w[0] for *_, w in lines if w[0] not in ("orbit", "make")])
    out = []
    for page, line, text, words in lines:
        if words[0] == "orbit":
            problem = check_orbit(words)
        elif words[0] == "make":
            problem = check_make(words)
        else:
            problem = check_bench(words, usages)
        if problem:
            out.append(f"{page}:{line}: {text}\n    {problem}")
    return out


if __name__ == "__main__":
    found = problems()
    print("\n".join(found) or f"docs-check: every command in {len(PAGES)} pages runs as written")
    sys.exit(1 if found else 0)
