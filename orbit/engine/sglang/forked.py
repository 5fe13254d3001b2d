"""On a CPU, the in-process engine's scheduler and detokenizer fork from Orbit's fork server
(orbit/host/forks.py) instead of starting as spawned interpreters that import SGLang again: 7-9 s
of a core each, most of what starting an engine costs here.

SGLang starts them as `Engine.run_scheduler_process_func` and `run_detokenizer_process_func` (class
attributes, its hooks for this), after `mp.set_start_method("spawn", force=True)`. `engine_class`
gives `sglang.Engine` targets that take the environment the engine had when it started them (its
run id, OMP_NUM_THREADS = engine.threads) and Orbit's CPU set-up, which a forked process does not
get from the fork server; `forking()` turns SGLang's "spawn" into "forkserver" while it starts.
GPU engines keep spawn (launch in process.py decides).
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from orbit.host.forks import adopt_env, child_env, forked_from_server, preload

# what SGLang's two processes run: imported by the fork server once, if it starts after `preloaded`
CHILD_MODULES = ["sglang.srt.managers.scheduler", "sglang.srt.managers.detokenizer_manager"]


class InStartingEnv:
    """A process target, named by module and function (a forked process imports SGLang only once
    Orbit's CPU set-up has run in it), run in the environment its starting process had when it
    started it: captured when pickled, that is at `Process.start`."""

    def __init__(self, module: str, name: str, env: dict[str, str] | None = None) -> None:
        self.module, self.name, self.env = module, name, env

    def __reduce__(self):
        return (InStartingEnv, (self.module, self.name, child_env()))

    def __call__(self, *args, **kwargs):
        import torch

        from orbit.engine.sglang_cpu import prepare_cpu_environment

        if self.env is not None:
            adopt_env(self.env)
        prepare_cpu_environment()
        # torch's threads: the fork server's OpenMP read OMP_NUM_THREADS at its own start
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        target = getattr(importlib.import_module(self.module), self.name)
        return target(*args, **kwargs)


def _target(func: Any) -> InStartingEnv:
    return InStartingEnv(func.__module__, func.__name__)


def engine_class(base: Any) -> Any:
    """`sglang.Engine` whose scheduler and detokenizer targets are `InStartingEnv`."""

    class ForkedEngine(base):
        run_scheduler_process_func = staticmethod(_target(base.run_scheduler_process_func))
        run_detokenizer_process_func = staticmethod(_target(base.run_detokenizer_process_func))

    return ForkedEngine


def preloaded() -> None:
    """This process will start in-process SGLang engines on the CPU: the fork server, if it has not
    started yet, imports SGLang's two processes' modules (with Orbit's CPU shims on) when it does,
    instead of each engine's processes importing them."""
    from orbit.engine.sglang_cpu import prepare_cpu_environment

    prepare_cpu_environment()  # before the fork server starts: it imports SGLang with the shims
    preload(CHILD_MODULES)


@contextmanager
def forking() -> Iterator[None]:
    """While `sglang.Engine` starts: its `set_start_method("spawn")` gives the fork server."""
    preloaded()
    forked_from_server(CHILD_MODULES)
    real = multiprocessing.set_start_method

    def fork_server(method: str | None, force: bool = False) -> None:  # noqa: ARG001 - SGLang's
        real("forkserver", force=True)

    multiprocessing.set_start_method = fork_server
    try:
        yield
    finally:
        multiprocessing.set_start_method = real
