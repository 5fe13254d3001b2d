"""Installs Orbit's GPU stand-ins (orbit_gpu_standins.py) at interpreter start-up, in every process
that has this directory on PYTHONPATH and ORBIT_GPU_STANDINS=1 (SGLang's spawned scheduler and
detokenizer too), then hands over to any other `sitecustomize` further down sys.path."""

import importlib.machinery
import importlib.util
import os
import sys

if os.environ.get("ORBIT_GPU_STANDINS") == "1":
    try:
        import orbit_gpu_standins

        orbit_gpu_standins.install()
    except Exception as exc:  # never break start-up; SGLang then fails where it would have
        print(f"orbit gpu stand-ins: not installed: {exc!r}", file=sys.stderr)


def _chain_next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    entries = [os.path.abspath(p or os.curdir) for p in sys.path]
    if here not in entries:
        return
    rest = sys.path[entries.index(here) + 1 :]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_chain_next_sitecustomize()
