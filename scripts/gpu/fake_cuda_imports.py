"""sglang's CUDA modules imported on a CPU with CUDA faked (an H200: sm90, CUDA 13), through Orbit's
GPU stand-ins (scripts/gpu/standins): what the lent machine imports before anything runs there, so
that a missing name fails here and not in a device minute. Run it as scripts/gpu/run.sh runs the
check (tests/test_gpu_standins.py does):

    PYTHONPATH=scripts/gpu/standins ORBIT_GPU_STANDINS=1 SGLANG_FORCE_FUSED_OP_BACKEND=torch \\
        .venv/bin/python scripts/gpu/fake_cuda_imports.py

Prints one line per module and exits 1 if any failed to import.
"""

from __future__ import annotations

import importlib
import sys
import time
import traceback

# what the engine path imports on CUDA: the engine and its processes, the model runner and the
# dense models, the Triton attention and LoRA backends, the sampler, the fused ops, the KV pools
MODULES = [
    "sglang.srt.entrypoints.engine",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.models.llama",
    "sglang.srt.models.qwen2",
    "sglang.srt.models.qwen3",
    "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.lora.backend.triton_backend",
    "sglang.srt.lora.backend.chunked_backend",
    "sglang.srt.layers.sampler",
    "sglang.srt.layers.layernorm",
    "sglang.srt.layers.activation",
    "sglang.srt.layers.dual_gemm",
    # what a Qwen2 MLP's dual-GEMM check imports (the stand-in, where cutlass is missing), and the
    # detokenizer at start (xgrammar, carried)
    "sglang.kernels.ops.gemm.cutedsl_dual_gemm",
    "sglang.srt.function_call.function_call_parser",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.memory_pool_host",
]


def fake_cuda() -> None:
    """torch says it has one H200. torchvision is imported first: on this machine its CUDA build
    loads only through Orbit's CPU fix, which stands aside once CUDA is visible."""
    import torch

    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - sglang then fails on it, and says so
        pass
    torch.cuda.is_available = lambda: True
    torch.version.cuda = "13.0"
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    torch.cuda.get_device_name = lambda device=None: "NVIDIA H200 (faked)"


def main() -> int:
    fake_cuda()
    import sgl_kernel

    assert getattr(sgl_kernel, "ORBIT_STANDIN", False), f"not the stand-in: {sgl_kernel.__file__}"
    failed = 0
    t0 = time.monotonic()
    for name in MODULES:
        try:
            importlib.import_module(name)
            print(f"ok      {name}")
        except Exception:  # noqa: BLE001 - each one reported
            failed += 1
            print(f"FAILED  {name}\n{traceback.format_exc(limit=-6)}")
    from sglang.srt.utils import is_cuda

    print(f"{len(MODULES) - failed} of {len(MODULES)} imported in {time.monotonic() - t0:.1f} s")
    print(f"is_cuda: {is_cuda()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
