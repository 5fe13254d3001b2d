"""The shape of the code that docs/design.md promises: imports that run one way, modules of a
readable size, and engines used through what their protocol declares (no capability probing)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "orbit"
# a warning, naming the file: a module longer than this is worth a look, not a failure (lines are at
# most 100 columns, as ruff format leaves them)
MAX_LINES = 500
# Packages by layer, lowest first: a package imports from its own layer or below, never above
# (docs/design.md, CONTRIBUTING.md). The RL math, tasks and engines know nothing of runs; runs know
# nothing of the command line. Every module lives in a package but the command line (cli.py) and the
# package's own face.
LAYERS = (
    ("host", "rl"),  # this machine and process; the RL math
    ("config",),  # what a recipe can say
    ("engine", "tasks", "metrics"),
    ("agents", "rollout", "push", "train", "models", "pages"),
    ("run",),  # one training run, from the recipe to its last step
    ("sweep", "measure", "serve"),
    ("cli",),
)
LOOSE = {"cli"}  # the only module at the top level
# Roles several packages each have: a package's protocol (engine/base.py, tasks/base.py), and each
# engine backend's engine and process (engine/embedded/, engine/sglang/)
SHARED_NAMES = {"base", "engine", "process"}
# Files that are not Orbit's modules: the CPU shims run inside SGLang's processes (docs/sglang.md).
OUTSIDE = ("engine/sglang_cpu/pypath/",)


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).as_posix()
        if any(part in rel for part in OUTSIDE):
            continue
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(
            ".__init__"
        )
        out[name] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Every orbit module `path` imports, at module level or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("orbit"):
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("orbit")}
    return {m for m in found if m in modules}


def test_the_import_graph_has_no_cycles():
    modules = _modules()
    graph = {m: _imports(p, modules) - {m} for m, p in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep) :] + [dep]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if dep not in state:
                visit(dep, path + [dep])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def _unit(module: str) -> str:
    """orbit.engine.sglang.http -> engine; orbit.cli -> cli."""
    return module.split(".")[1] if "." in module else module


def test_modules_live_in_packages_named_for_what_they_do():
    loose = sorted(
        m.split(".")[1]
        for m, p in _modules().items()
        if m.count(".") == 1 and p.name != "__init__.py"
    )
    assert set(loose) == LOOSE, (
        f"modules loose at the top of orbit/ (put each in the package of its layer): {loose}"
    )


def test_no_two_modules_share_a_name_without_a_reason():
    """Two modules of one name need reading to tell apart, unless the name is a role every package
    of a kind has (SHARED_NAMES)."""
    by_name: dict[str, list[str]] = {}
    for name, path in _modules().items():
        if path.name != "__init__.py":
            by_name.setdefault(path.stem, []).append(name)
    same = {
        stem: names
        for stem, names in by_name.items()
        if len(names) > 1 and stem not in SHARED_NAMES
    }
    assert not same, f"modules that share a name: {same}"


def test_every_built_in_task_has_its_options_and_its_class():
    """One list of built-in tasks (orbit/config/task.py's BUILTINS); each has a task class of that
    name."""
    import orbit.config.task
    import orbit.tasks

    assert list(orbit.tasks.BUILTINS) == list(orbit.config.task.BUILTINS)


def test_imports_run_down_the_layers():
    layer = {unit: i for i, units in enumerate(LAYERS) for unit in units}
    modules = _modules()
    unplaced = sorted({_unit(m) for m in modules if m != "orbit"} - set(layer))
    assert not unplaced, f"modules in no layer (add them to LAYERS): {unplaced}"
    upward = []
    for name, path in modules.items():
        if name == "orbit":
            continue
        for dep in _imports(path, modules):
            if dep != "orbit" and layer[_unit(dep)] > layer[_unit(name)]:
                upward.append(
                    f"{name} (layer {layer[_unit(name)]}) imports {dep} (layer {layer[_unit(dep)]})"
                )
    assert not upward, "imports that run up the layers:\n" + "\n".join(sorted(upward))


def test_modules_stay_readable():
    """Long modules are named as a warning: split by idea, not to meet a number."""
    import warnings

    for p in _modules().values():
        if (n := len(p.read_text().splitlines())) > MAX_LINES:
            warnings.warn(
                f"{p.relative_to(ROOT.parent).as_posix()} has {n} lines (over {MAX_LINES}): one "
                "idea?",
                stacklevel=1,
            )


def test_engines_are_used_through_their_protocol():
    """No `getattr(engine, ...)`-style probing of an engine, a pool member or a transport: what
    callers use is declared on the protocol (orbit/engine/base.py, Transport)."""
    probes = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
            ):
                target = ast.unparse(node.args[0])
                if any(word in target for word in ("engine", "pool", "member", "transport")):
                    probes.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert not probes, "\n".join(probes)
