"""Stub of SGLang's `sgl_kernel` extension for CPU-only machines (Orbit shim).

With SGLANG_USE_CPU_ENGINE=1, SGLang 0.5.x imports helpers from the CPU build of `sgl_kernel` at
module level (mem_cache/allocation.py, speculative decoding, the AMX attention backend):
`assign_req_to_token_pool_cpu`, `copy_all_layer_kv_cache_cpu`, `assign_extend_cache_locs_cpu`,
`assign_draft_cache_locs_contiguous_cpu`, `build_tree_kernel_efficient_cpu`,
`fill_accept_out_cache_loc_cpu`, `fill_bonus_tokens_cpu`, `verify_tree_greedy_cpu`, ...
There is no CPU wheel of sgl-kernel on PyPI (sgl-kernel / sglang-kernel are CUDA builds), so the
import fails before the engine can start. For a dense Llama/Qwen2 model with the torch_native
attention backend on a CPU without AMX, none of these is ever *called*; this stub makes the
imports succeed, and any real call raises NotImplementedError naming the function, so a code
path that needs a real kernel (speculative decoding, AMX, Mamba/GDN) fails loudly, not silently.

Feature checks in SGLang look at `torch.ops.sgl_kernel.*`, which this stub does not register, so
no optimised path is selected because of it. Lives on PYTHONPATH only while Orbit's CPU shims
are on (`orbit.engine.sglang_cpu.prepare_cpu_environment`).
"""

__version__ = "0.0.0+orbit.cpu.stub"
ORBIT_STUB = True

_KNOWN = (
    "assign_req_to_token_pool_cpu",
    "copy_all_layer_kv_cache_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
    "build_draft_decode_metadata_cpu",
)


def _stub(qualname: str):
    def not_implemented(*args, **kwargs):
        raise NotImplementedError(
            f"{qualname} is not available: Orbit runs SGLang on CPU with a stub sgl_kernel (no CPU "
            "build of sgl-kernel exists on PyPI); this code path needs the real kernel"
        )

    not_implemented.__name__ = qualname.rsplit(".", 1)[-1]
    not_implemented.__qualname__ = qualname
    return not_implemented


for _name in _KNOWN:
    globals()[_name] = _stub(f"sgl_kernel.{_name}")


def __getattr__(name: str):
    # Any other `from sgl_kernel import X` also imports (X raises when called). Dunder/private
    # names stay missing so that introspection (hasattr(mod, "__path__"), pickling) is not fooled.
    if name.startswith("_"):
        raise AttributeError(name)
    fn = _stub(f"sgl_kernel.{name}")
    globals()[name] = fn
    return fn
