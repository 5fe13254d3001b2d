"""What sglang 0.5.23 needs on the lent GPU machine that its CUDA wheels would have brought, had
they fitted in a device command's 64 MiB (../shared/notes/gpu-sglang.md). Installed by the
`sitecustomize.py` beside it in every process that has this directory on PYTHONPATH and
ORBIT_GPU_STANDINS=1 (scripts/gpu/run.sh sets both), never on a user's machine: `pip install
'orbit-rl[sglang]'` brings SGLang's real kernels (docs/sglang.md, "On a GPU").

- `sgl_kernel`: the stand-in package in this directory (its ops in plain torch, other names raise).
- `sglang.kernels.ops.gemm.cutedsl_dual_gemm`: imported by every Llama/Qwen2/Qwen3 MLP's dual-GEMM
  check, its module level imports NVIDIA's cutlass DSL unguarded. The kernel is Blackwell-only
  (SM100): the stand-in says it cannot be used, so the MLP takes gate_up + SiluAndMul + down.
- `IPython.display` (HTML, display), imported at load: a stand-in where IPython is not installed.
- `sglang.srt.mem_cache.memory_pool.can_use_store_cache`: it tries to build the KV store kernel with
  tvm-ffi and nvcc on every call and does not remember a failure; it answers once per row width now
  (a failed build: SGLang's plain indexing writes the KV).

Each acts only where the real module cannot be imported (the dual GEMM: where cutlass cannot).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from enum import IntEnum

ENV_FLAG = "ORBIT_GPU_STANDINS"
DUAL_GEMM = "sglang.kernels.ops.gemm.cutedsl_dual_gemm"
MEMORY_POOL = "sglang.srt.mem_cache.memory_pool"
IPYTHON = ("IPython", "IPython.display")


def enabled() -> bool:
    return os.environ.get(ENV_FLAG) == "1"


def install() -> None:
    """The import hook (no-op without the flag; safe to call again)."""
    if not enabled() or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())


class DualGemmQuantMode(IntEnum):  # the real module's values
    STATIC_PER_TENSOR = 0
    STATIC_PER_TOKEN = 1
    DYNAMIC_PER_TENSOR = 2
    DYNAMIC_PER_TOKEN = 3
    UNQUANT = 4


def _dual_gemm_module(name: str = DUAL_GEMM) -> types.ModuleType:
    m = types.ModuleType(name, "Orbit's stand-in: the SM100 dual GEMM is never used")
    m.MAX_DUAL_GEMM_DECODE_TOKENS = 16
    m.DualGemmQuantMode = DualGemmQuantMode
    m.can_use_dual_gemm = lambda *args, **kwargs: False

    def unavailable(*args, **kwargs):
        raise NotImplementedError(f"{DUAL_GEMM} is Orbit's stand-in: no dual GEMM kernel here")

    m.dual_gemm_swiglu = m.dual_gemm_swiglu_fp8 = unavailable
    return m


def _ipython_module(name: str) -> types.ModuleType:
    m = types.ModuleType(name, "Orbit's stand-in: IPython is not installed")
    if name == "IPython":
        m.__path__ = []  # a package, so that IPython.display is looked for
    else:
        m.HTML = lambda data=None, *args, **kwargs: data
        m.display = lambda *objs, **kwargs: None
    return m


class _StandinLoader(importlib.abc.Loader):
    def __init__(self, make) -> None:
        self.make = make

    def create_module(self, spec):
        return self.make(spec.name)

    def exec_module(self, module) -> None:
        pass


class _PatchingLoader(importlib.abc.Loader):
    """The real module, patched once it has run."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        if module.__name__ == MEMORY_POOL:
            module.can_use_store_cache = functools.cache(module.can_use_store_cache)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in (DUAL_GEMM, MEMORY_POOL, *IPYTHON):
            return None
        real = _real_spec(self, fullname, path, target)
        if fullname == MEMORY_POOL:
            if real is not None and real.loader is not None:
                real.loader = _PatchingLoader(real.loader)
            return real
        if fullname == DUAL_GEMM and importlib.util.find_spec("cutlass") is not None:
            return real
        if fullname in IPYTHON and real is not None:
            return real
        make = _dual_gemm_module if fullname == DUAL_GEMM else _ipython_module
        return importlib.machinery.ModuleSpec(
            fullname, _StandinLoader(make), is_package=fullname == "IPython"
        )


def _real_spec(me, fullname, path, target):
    for finder in sys.meta_path:
        if finder is me or not hasattr(finder, "find_spec"):
            continue
        spec = finder.find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None
