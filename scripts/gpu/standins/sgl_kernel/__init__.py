"""A stand-in for SGLang's `sgl_kernel` (the sglang-kernel wheel) on the lent GPU machine, which
has no network and no room for that wheel (373 MB): scripts/gpu/run.sh puts this directory on
PYTHONPATH there, never on a user's machine (`pip install 'orbit-rl[sglang]'` brings the real
kernels).

sglang 0.5.23 imports a few of its names at module level on CUDA (layernorm, activation, sampler,
the Triton attention backend, the host KV pool). With SGLANG_FORCE_FUSED_OP_BACKEND=torch and the
pytorch sampling backend none is called; the ones below still compute what the kernels compute, in
plain torch (tests/test_gpu_standins.py holds them to their definitions), and every other name
imports and raises NotImplementedError naming itself when called: a path that needs a real kernel
fails loudly.
"""

from __future__ import annotations

import torch

from sgl_kernel._missing import module_getattr

__version__ = "0.0.0+orbit.gpu.standin"
ORBIT_STANDIN = True


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    var = x.float().pow(2).mean(dim=-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + eps) * (weight.float() + offset)).to(x.dtype)


def rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):  # noqa: A002, ARG001 - its names
    """x / sqrt(mean(x^2) + eps) * weight, into `out` when given."""
    result = _rms(input, weight, eps, 0.0)
    return result if out is None else out.copy_(result)


def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):  # noqa: A002, ARG001
    """In place: residual += input; input = rmsnorm(residual)."""
    residual.add_(input)
    input.copy_(_rms(residual, weight, eps, 0.0))


def gemma_rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):  # noqa: A002, ARG001
    """Gemma's RMSNorm scales by (1 + weight)."""
    result = _rms(input, weight, eps, 1.0)
    return result if out is None else out.copy_(result)


def gemma_fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):  # noqa: A002, ARG001
    residual.add_(input)
    input.copy_(_rms(residual, weight, eps, 1.0))


def _gated(act, input: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:  # noqa: A002
    d = input.shape[-1] // 2
    result = act(input[..., :d].float()).to(input.dtype) * input[..., d:]
    return result if out is None else out.copy_(result)


def silu_and_mul(input, out=None, enable_pdl=None):  # noqa: A002, ARG001
    """silu(first half) * second half of the last dimension."""
    return _gated(torch.nn.functional.silu, input, out)


def gelu_and_mul(input, out=None, enable_pdl=None):  # noqa: A002, ARG001
    return _gated(torch.nn.functional.gelu, input, out)


def gelu_tanh_and_mul(input, out=None, enable_pdl=None):  # noqa: A002, ARG001
    return _gated(lambda t: torch.nn.functional.gelu(t, approximate="tanh"), input, out)


def _per_row(value, rows: int, device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(device).reshape(-1).expand(rows) if value.numel() == 1 else value.to(device)
    return torch.full((rows,), value, device=device)


def top_k_renorm_prob(probs, top_k):
    """Each row's probabilities outside its k largest set to 0, the rest renormalised (k <= 0 or
    >= the vocabulary: all kept)."""
    k = _per_row(top_k, probs.shape[0], probs.device).long()
    k = torch.where((k <= 0) | (k > probs.shape[-1]), probs.shape[-1], k)
    ranked = probs.sort(dim=-1, descending=True).values
    threshold = ranked.gather(-1, (k - 1).unsqueeze(-1))
    kept = torch.where(probs >= threshold, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


def top_p_renorm_prob(probs, top_p):
    """Each row keeps its most probable tokens whose mass before them is below p (the first always),
    renormalised."""
    p = _per_row(top_p, probs.shape[0], probs.device).to(probs.dtype)
    ranked, order = probs.sort(dim=-1, descending=True)
    before = ranked.cumsum(dim=-1) - ranked
    keep_ranked = before < p.unsqueeze(-1)
    keep_ranked[..., 0] = True
    keep = torch.zeros_like(keep_ranked).scatter(-1, order, keep_ranked)
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


__getattr__ = module_getattr(__name__)
