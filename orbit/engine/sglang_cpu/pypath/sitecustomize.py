"""Installs Orbit's SGLang CPU shims at interpreter start-up, in every process that has this
directory on PYTHONPATH and ORBIT_SGLANG_CPU_SHIMS=1 (both set by
`orbit.engine.sglang_cpu.prepare_cpu_environment()` and inherited by SGLang's spawned scheduler
and detokenizer processes; forked ones, in a CPU server Orbit starts, inherit the shims).
Installing costs nothing: it adds an import hook that acts only when torchvision or SGLang's
LoRA modules are imported. Afterwards it hands over to any other `sitecustomize` further down
sys.path, which this file would otherwise shadow.
"""

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))

if os.environ.get("ORBIT_SGLANG_CPU_SHIMS") == "1":
    try:
        import orbit_sglang_cpu_shims

        orbit_sglang_cpu_shims.install()
    except Exception as exc:  # never break interpreter start-up; SGLang then fails where it would
        print(f"orbit sglang cpu shims: not installed: {exc!r}", file=sys.stderr)


def _chain_next_sitecustomize() -> None:
    """Run the `sitecustomize` that Python would have found after this directory, if any.

    Only entries *after* this directory are searched, so two chaining sitecustomize files on
    the path cannot hand over to each other forever."""
    import importlib.machinery
    import importlib.util

    entries = [os.path.abspath(p or os.curdir) for p in sys.path]
    if _here not in entries:
        return
    rest = sys.path[entries.index(_here) + 1 :]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_chain_next_sitecustomize()
