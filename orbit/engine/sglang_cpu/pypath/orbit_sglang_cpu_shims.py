"""Orbit's compatibility shims for running SGLang 0.5.x on a CPU-only machine.

This file lives in a directory that `orbit.engine.sglang_cpu.prepare_cpu_environment()` puts on
PYTHONPATH, so it is importable (and installed by the `sitecustomize.py` beside it) in Orbit's
own process and in every process SGLang spawns (scheduler, detokenizer: multiprocessing "spawn";
a CPU server Orbit starts forks them, and they inherit the shims). It must not import `orbit` (a
subprocess need not be able to) and must stay cheap at start-up: `install()` only adds an import
hook; torch is touched only when torchvision, one of SGLang's LoRA modules or its sampling
modules is actually imported.

Nothing here runs unless ORBIT_SGLANG_CPU_SHIMS=1, and no shim acts when a CUDA device is
visible. All are idempotent. Nothing here replaces a function in torch's own namespace: torch
identifies factory functions by identity (torch.utils._device._device_constructors, used by
`with torch.device(...)`), and a global wrapper around `torch.tensor` made transformers load
garbage rotary buffers (NaN logits) in the same process. That is why (c) patches only the
`torch` name inside SGLang's LoRA modules.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

ENV_FLAG = "ORBIT_SGLANG_CPU_SHIMS"

# Modules whose code hard-codes pinned host buffers on the LoRA path (sglang 0.5.23).
PIN_MEMORY_MODULES = frozenset(
    {
        "sglang.srt.lora.layers",
        "sglang.srt.lora.backend.torch_backend",
        "sglang.srt.lora.mem_pool",
    }
)
# Where SGLang builds and merges a batch's sampling parameters, and where it samples: (d)
SEED_MODULES = frozenset({"sglang.srt.sampling.sampling_batch_info", "sglang.srt.layers.sampler"})


def enabled() -> bool:
    return os.environ.get(ENV_FLAG) == "1"


def _cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


def install() -> None:
    """Install the import hook for (a), (c) and (d) (no-op without the flag). Safe to call again."""
    if not enabled():
        return
    _finder().watched |= PIN_MEMORY_MODULES | {"torchvision"} | SEED_MODULES
    # Modules imported before the hook was installed (e.g. prepare_cpu_environment() called late).
    for name in (PIN_MEMORY_MODULES | SEED_MODULES) & set(sys.modules):
        _after_import(name, sys.modules[name])


def install_torchvision_fix() -> None:
    """Install only (a), unconditionally: for the `.pth` file that scripts/install_sglang.sh
    writes into a CPU venv's site-packages. That venv holds the CUDA torchvision wheel, so every
    process that imports transformers' vision utilities or torchvision needs (a), not only
    SGLang's process tree. Costs nothing until torchvision is imported."""
    _finder().watched.add("torchvision")


def _finder() -> _ShimFinder:
    for f in sys.meta_path:
        if isinstance(f, _ShimFinder):
            return f
    f = _ShimFinder()
    sys.meta_path.insert(0, f)
    return f


class _ShimFinder(importlib.abc.MetaPathFinder):
    """Runs `_before_import` / `_after_import` around the modules the shims care about."""

    def __init__(self):
        self.watched: set[str] = set()

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.watched:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _ShimLoader(spec.loader)
        return spec


class _ShimLoader(importlib.abc.Loader):
    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        _before_import(module.__name__)
        self._inner.exec_module(module)
        _after_import(module.__name__, module)

    def __getattr__(self, name):  # get_source, is_package, ... for tools that ask the loader
        return getattr(self._inner, name)


def _before_import(name: str) -> None:
    if name == "torchvision":
        fix_torchvision_op_schemas()


def _after_import(name: str, module) -> None:
    if name in PIN_MEMORY_MODULES:
        unpin_module(module)
    elif name in SEED_MODULES:
        honour_sampling_seeds(module)


# --- (a) torchvision::nms / torchvision::qnms ------------------------------------------------
# SGLang imports torchvision unconditionally (sglang.srt.configs -> multimodal/internvl_utils; also
# transformers.image_utils when torchvision is installed). PyPI has no CPU torchvision wheel: the
# x86-64 wheel matching torch 2.13 (torchvision 0.28.0) is a CUDA build whose C++ extension
# (_C.so) cannot be loaded next to CPU torch. torchvision then still runs
# `_meta_registrations.py`, where `@torch.library.register_fake("torchvision::nms")` (and `qnms`)
# require the operator to exist, so `import torchvision` dies with
# "operator torchvision::nms does not exist". Defining only the two schemas (no kernel) lets the
# import finish; calling nms/qnms still fails loudly ("no kernel for CPU"). When _C.so *does*
# load (a matching CPU build), it registers the real ops and nothing is defined here.
_TV_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_tv_lib = None  # keep the Library alive: dropping it unregisters the schemas


def fix_torchvision_op_schemas() -> None:
    global _tv_lib
    if _tv_lib is not None or (
        "torchvision" in sys.modules and hasattr(sys.modules["torchvision"], "ops")
    ):
        return
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return  # torchvision not installed: nothing to fix
    if _cuda_visible():
        return
    import torch

    ext = os.path.join(list(spec.submodule_search_locations)[0], "_C.so")
    if os.path.exists(ext):
        try:
            torch.ops.load_library(ext)  # the same load torchvision.extension tries first
            return  # a working extension registered the real ops
        except (OSError, ImportError):
            pass
    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _TV_SCHEMAS:
        name = schema.split("(", 1)[0]
        if not torch._C._jit_get_schemas_for_operator(f"torchvision::{name}"):
            lib.define(schema)
    _tv_lib = lib


# --- (c) pin_memory --------------------------------------------------------------------------
# SGLang's LoRA code hard-codes pinned host staging buffers:
# `torch.tensor(..., pin_memory=True)` in lora/layers.py (slice offsets of qkv/gate_up),
# `torch.zeros/tensor(..., pin_memory=True)` and `t.pin_memory()` in
# lora/backend/torch_backend.py (per-batch segment info), `weight.pin_memory()` in lora/mem_pool.py.
# Pinned (page-locked) memory needs an accelerator runtime; CPU-only torch raises
# "pin_memory=True requires a CUDA or other accelerator backend" / "Cannot access accelerator
# device when none is available", so `enable_lora=True` crashes at engine start. On a CPU engine
# the host buffer *is* the device buffer, so pinning is meaningless. Fix, CPU only: inside those
# modules the name `torch` becomes a proxy whose factory functions drop `pin_memory` (everything
# else is torch itself), and `Tensor.pin_memory()` returns the tensor (it can only raise on a
# CPU-only build). torch's own namespace is left alone (see the module docstring).
_FACTORIES = (
    "empty",
    "zeros",
    "ones",
    "full",
    "tensor",
    "arange",
    "empty_strided",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
)


class _TorchWithoutPinMemory:
    """`torch` as seen by one SGLang module: factories ignore `pin_memory`."""

    def __init__(self, torch_module):
        self.__dict__["_torch"] = torch_module
        for name in _FACTORIES:
            fn = getattr(torch_module, name)

            def unpinned(*args, _fn=fn, **kwargs):
                kwargs.pop("pin_memory", None)
                return _fn(*args, **kwargs)

            unpinned.__name__ = name
            self.__dict__[name] = unpinned

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def __setattr__(self, name, value):
        setattr(self._torch, name, value)

    def __repr__(self):
        return f"<torch without pin_memory (Orbit CPU shim) for {self._torch!r}>"


def _tensor_pin_memory_identity(self, device=None):  # signature of Tensor.pin_memory
    return self


def unpin_module(module) -> None:
    if _cuda_visible():
        return
    import torch

    if getattr(module, "torch", None) is torch:
        module.torch = _TorchWithoutPinMemory(torch)
    if torch.Tensor.pin_memory is not _tensor_pin_memory_identity:
        torch.Tensor.pin_memory = _tensor_pin_memory_identity


# --- (d) a request's sampling_seed -----------------------------------------------------------
# SGLang reads `sampling_seed` only under --enable-deterministic-inference, which needs a GPU
# attention backend (FlashInfer, FA3, Triton): on a CPU the seed is dropped and the same seed
# samples differently. Its pytorch sampling backend (the CPU's) samples a row that has a seed by a
# Gumbel draw from (seed, position), but the batch's seed tensor is never built, and the draw's
# hash is a kernel the CPU has not got (`sgl_kernel.murmur_hash32_cpu`). Fix, CPU only: a batch
# that holds a seeded request gets the tensor, its unseeded rows a random seed each (so they stay
# random, unlike SGLang's 42), a merge of a seeded batch with an unseeded one seeds the other side
# alike, and the draw takes its uniforms from a torch generator seeded by (seed, position): the
# same request samples the same whatever else is in the batch. Batches with no seed are untouched.
def _random_seeds(seeds, device):
    import random

    import torch

    drawn = [random.getrandbits(62) if s is None else int(s) for s in seeds]
    return torch.tensor(drawn, dtype=torch.int64, device=device)


def _seeded_gumbel_argmax(logprobs, seed, positions):
    """[n, 1] argmax(logprobs + Gumbel noise), the noise of row i fixed by (seed[i], positions[i])
    (SGLang's multinomial_with_seed, with torch's generator for its hash)."""
    import torch

    n, m = logprobs.shape
    out = torch.empty((n, 1), dtype=torch.long, device=logprobs.device)
    tiny = torch.finfo(torch.float64).tiny
    for i, (s, p) in enumerate(zip(seed.tolist(), positions.tolist(), strict=True)):
        gen = torch.Generator().manual_seed(hash((int(s), int(p))) & (2**63 - 1))
        u = torch.rand(m, generator=gen, dtype=torch.float64).clamp_(min=tiny)
        out[i, 0] = torch.argmax(logprobs[i].double() - torch.log(-torch.log(u)))
    return out


def honour_sampling_seeds(module) -> None:
    if _cuda_visible():
        return
    if hasattr(module, "multinomial_with_seed"):  # the sampler
        module.multinomial_with_seed = _seeded_gumbel_argmax
        return
    cls = module.SamplingBatchInfo
    if getattr(cls, "_orbit_seeds", False):
        return
    build = cls.from_schedule_batch.__func__
    merge = cls.merge_batch

    def from_schedule_batch(klass, batch, vocab_size):
        info = build(klass, batch, vocab_size)
        seeds = [r.sampling_params.sampling_seed for r in batch.reqs]
        if info.sampling_seed is None and any(s is not None for s in seeds):
            info.sampling_seed = _random_seeds(seeds, info.device)
        return info

    def merge_batch(self, other):
        if (self.sampling_seed is None) != (other.sampling_seed is None):
            for side in (self, other):
                if side.sampling_seed is None:
                    side.sampling_seed = _random_seeds([None] * len(side), side.device)
        return merge(self, other)

    cls.from_schedule_batch = classmethod(from_schedule_batch)
    cls.merge_batch = merge_batch
    cls._orbit_seeds = True
