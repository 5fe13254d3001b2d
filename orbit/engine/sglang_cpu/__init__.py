"""Run SGLang's engine on a CPU-only machine: Orbit's own compatibility shims.

SGLang 0.5.x targets GPUs. On a CPU-only torch build it needs three small fixes, all in
`pypath/` (a directory put on PYTHONPATH so SGLang's spawned scheduler/detokenizer processes
get them too):

(a) `orbit_sglang_cpu_shims.fix_torchvision_op_schemas` - defines the `torchvision::nms`/`qnms`
    op schemas before torchvision is imported (the only torchvision wheel is a CUDA build whose
    extension does not load next to CPU torch, and its meta registrations then fail the import).
(b) `sgl_kernel/` - a stub of the CUDA/CPU kernel package SGLang imports from at module level
    with SGLANG_USE_CPU_ENGINE=1; every function raises NotImplementedError naming itself.
(c) `orbit_sglang_cpu_shims.unpin_module` - SGLang's LoRA code hard-codes pinned host buffers,
    which need an accelerator; on CPU the tensor factories *as seen by those SGLang modules* drop
    `pin_memory` and `Tensor.pin_memory()` is the identity (torch's namespace is not touched).

(a) and (c) are installed by `pypath/sitecustomize.py` at start-up of each process of the tree
as an import hook (they act when torchvision / SGLang's LoRA modules are imported), only when
ORBIT_SGLANG_CPU_SHIMS=1, and they do nothing when a CUDA device is visible. See docs/sglang.md.

Call `prepare_cpu_environment()` once, before importing `sglang`, and only for device="cpu".

`adapter_format.to_sglang_lora` (LoRA export -> what SGLang loads correctly) lives here too but is
not CPU-specific: the SGLang backend needs it on GPU as well.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SHIM_DIR = Path(__file__).resolve().parent / "pypath"
ENV_FLAG = "ORBIT_SGLANG_CPU_SHIMS"

__all__ = ["SHIM_DIR", "ENV_FLAG", "prepare_cpu_environment", "shims_active"]


def prepare_cpu_environment() -> None:
    """Set up this process and every process it spawns to run SGLang's engine on the CPU.

    - SGLANG_USE_CPU_ENGINE=1: SGLang's CPU model/kernel paths (without it the model build tries
      to import vllm).
    - ORBIT_SGLANG_CPU_SHIMS=1: turns on shims (a) and (c) in `pypath/sitecustomize.py`.
    - SHIM_DIR first on PYTHONPATH (inherited by spawned children, whose `sitecustomize` then
      applies the shims at start-up) and on this process's sys.path (the stub `sgl_kernel`).
    - installs the import hook for (a) and (c) in this process now (its start-up ran before the
      flag was set).

    Idempotent. Must run before `import sglang` (which imports torchvision). Does not touch
    CUDA machines' behaviour beyond the env vars: the shims themselves check for CUDA.
    """
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    os.environ[ENV_FLAG] = "1"
    shim = str(SHIM_DIR)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if shim not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([shim, *parts])
    if shim not in sys.path:
        sys.path.insert(0, shim)
    loaded = sys.modules.get("sgl_kernel")
    if loaded is not None and not getattr(loaded, "ORBIT_STUB", False):
        raise RuntimeError(
            "a real sgl_kernel is already imported in this process; the CPU engine needs Orbit's "
            "stub (call prepare_cpu_environment() before importing sglang)"
        )
    import orbit_sglang_cpu_shims

    orbit_sglang_cpu_shims.install()


def shims_active() -> bool:
    """True when prepare_cpu_environment() ran in this process (or its parent)."""
    return os.environ.get(ENV_FLAG) == "1" and str(SHIM_DIR) in sys.path
