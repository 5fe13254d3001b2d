"""User tasks by import path: `task: {name: "mypkg.tasks:make_task", ...options}`.

The factory is called as `factory(tokenizer, **options)` and must return a task
(orbit/tasks/base.py). `name` may also point at a file: `tasks/my_task.py:make_task`. The working
directory is importable, as with `python -m`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path


class TaskLoadError(ValueError):
    """A task import path that does not lead to a callable factory."""


def resolve_factory(spec: str) -> Callable:
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise TaskLoadError(
            f"{spec!r} is not an import path: expected 'module:factory' or 'file.py:factory'"
        )
    if module_name.endswith(".py"):
        module = _load_file(Path(module_name), spec)
    else:
        cwd = os.getcwd()
        if cwd not in sys.path and "" not in sys.path:
            sys.path.insert(0, cwd)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            raise TaskLoadError(f"cannot import {module_name!r} for task {spec!r}: {err}") from None
        # any failure of the user's module is reported as such
        except Exception as err:  # noqa: BLE001
            raise TaskLoadError(
                f"importing {module_name!r} for task {spec!r} raised {type(err).__name__}: {err}"
            ) from None
    try:
        factory = getattr(module, attr)
    except AttributeError:
        raise TaskLoadError(
            f"module {module_name!r} has no attribute {attr!r} (task {spec!r})"
        ) from None
    if not callable(factory):
        raise TaskLoadError(f"{spec!r} is a {type(factory).__name__}, not a callable task factory")
    return factory


def _load_file(path: Path, spec: str):
    if not path.is_file():
        raise TaskLoadError(f"no such file {str(path)!r} (task {spec!r})")
    name = f"orbit_user_task_{abs(hash(str(path.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise TaskLoadError(f"cannot load {str(path)!r} as a Python module (task {spec!r})")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001
        del sys.modules[name]
        raise TaskLoadError(
            f"loading {str(path)!r} for task {spec!r} raised {type(err).__name__}: {err}"
        ) from None
    return module
