"""The lent GPU machine's stand-ins for SGLang's CUDA wheels (scripts/gpu/standins): each op is what
the kernel it stands for computes, a name it lacks fails loudly, and sglang's CUDA modules import
through them with CUDA faked (scripts/gpu/fake_cuda_imports.py) before a GPU minute is spent."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from orbit.rl.truncation import kept_sorted

ROOT = Path(__file__).resolve().parent.parent
STANDINS = ROOT / "scripts" / "gpu" / "standins"


@pytest.fixture(scope="module")
def sgl_kernel():
    """The stand-in package, imported under its own name for this module's tests only (a test
    process may hold the CPU stub of that name: tests/test_sglang.py)."""
    saved = {k: v for k, v in sys.modules.items() if _ours(k)}
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, str(STANDINS))
    try:
        import sgl_kernel

        assert sgl_kernel.ORBIT_STANDIN
        yield sgl_kernel
    finally:
        sys.path.remove(str(STANDINS))
        for k in [k for k in sys.modules if _ours(k)]:
            del sys.modules[k]
        sys.modules.update(saved)


def _ours(module: str) -> bool:
    return module == "sgl_kernel" or module.startswith("sgl_kernel.")


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_rmsnorm_and_its_fused_add_are_the_definitions(sgl_kernel):
    x, w, r = _x(5, 64), _x(64, seed=1), _x(5, 64, seed=2)
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    assert torch.allclose(sgl_kernel.rmsnorm(x, w, 1e-6), want, atol=1e-6)
    out = torch.empty_like(x)
    assert sgl_kernel.rmsnorm(x, w, 1e-6, out=out) is out and torch.allclose(out, want, atol=1e-6)
    gemma = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w)
    assert torch.allclose(sgl_kernel.gemma_rmsnorm(x, w, 1e-6), gemma, atol=1e-6)
    # in place: the residual takes the sum, the input its norm
    xi, ri = x.clone(), r.clone()
    sgl_kernel.fused_add_rmsnorm(xi, ri, w, 1e-6)
    s = x + r
    assert torch.equal(ri, s)
    assert torch.allclose(xi, s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w, atol=1e-6)
    xi, ri = x.clone(), r.clone()
    sgl_kernel.gemma_fused_add_rmsnorm(xi, ri, w, 1e-6)
    assert torch.allclose(
        xi, s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w), atol=1e-6
    )


def test_gated_activations_are_the_definitions(sgl_kernel):
    x = _x(3, 2 * 32)
    gate, up = x[:, :32], x[:, 32:]
    F = torch.nn.functional
    for name, act in (
        ("silu_and_mul", F.silu),
        ("gelu_and_mul", F.gelu),
        ("gelu_tanh_and_mul", lambda t: F.gelu(t, approximate="tanh")),
    ):
        out = torch.empty(3, 32)
        got = getattr(sgl_kernel, name)(x, out)
        assert got is out and torch.allclose(out, act(gate) * up, atol=1e-6), name


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (1, 1.0), (0, 0.8), (384, 0.3), (7, 0.5)])
def test_renormalised_probabilities_keep_orbits_truncation_rule(sgl_kernel, top_k, top_p):
    """Each renormalisation sums to 1 over what it keeps, and composed as SGLang composes them
    (top-k's kept set cut by top-p's, both of the same probabilities) they keep what Orbit's
    engines and trainer keep: the rule sampling and scoring share (orbit/rl/truncation.py)."""
    probs = torch.softmax(_x(4, 384) * 3, -1)
    by_k = sgl_kernel.top_k_renorm_prob(probs, torch.full((4,), top_k))
    by_p = sgl_kernel.top_p_renorm_prob(probs, torch.full((4,), top_p))
    for got in (by_k, by_p):
        assert torch.allclose(got.sum(-1), torch.ones(4), atol=1e-6)
        kept = got > 0
        want = torch.where(kept, probs, 0.0)
        assert torch.allclose(got, want / want.sum(-1, keepdim=True), atol=1e-6)
    ranked, order = probs.sort(-1, descending=True)
    rule = kept_sorted(ranked, torch.full((4,), top_p), torch.full((4,), top_k))
    assert torch.equal((by_k > 0) & (by_p > 0), torch.zeros_like(rule).scatter(-1, order, rule))


def test_a_name_the_stand_in_lacks_imports_and_fails_when_called(sgl_kernel):
    from sgl_kernel.kvcacheio import transfer_kv_all_layer
    from sgl_kernel.utils import is_arch_support_pdl

    assert is_arch_support_pdl() is False
    with pytest.raises(NotImplementedError, match="sgl_kernel.kvcacheio.transfer_kv_all_layer"):
        transfer_kv_all_layer(None)
    with pytest.raises(NotImplementedError, match="scalar_type.scalar_types.uint4b8"):
        sgl_kernel.scalar_type.scalar_types.uint4b8()


@pytest.mark.sglang  # skips without sglang, fails in CI (tests/sglang_gate.py)
@pytest.mark.slow
def test_sglangs_cuda_modules_import_through_the_stand_ins_with_cuda_faked():
    """What the lent machine imports first: the engine and its processes, the model runner and the
    dense models, the Triton attention and LoRA backends, the sampler, the KV pools."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("SGLANG_USE_CPU_ENGINE", "ORBIT_SGLANG_CPU_SHIMS", "PYTHONPATH")
    }
    env.update(
        PYTHONPATH=str(STANDINS),
        ORBIT_GPU_STANDINS="1",
        SGLANG_FORCE_FUSED_OP_BACKEND="torch",
        SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK="1",
        SGLANG_IS_FLASHINFER_AVAILABLE="false",
        SGLANG_ENABLE_JIT_DEEPGEMM="0",
    )
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu" / "fake_cuda_imports.py")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    print(res.stdout[-2000:])
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-3000:]
    assert "is_cuda: True" in res.stdout


def test_every_orbit_requirement_is_carried_or_on_the_lent_machine():
    """A dependency Orbit adds must reach the lent GPU machine (it has no network): pinned in
    requirements/gpu-carry.txt or in the image's list. pyrage and itsdangerous were once neither,
    and only a device minute's `make gpu-carry` said so."""
    sys.path.insert(0, str(ROOT / "scripts" / "gpu"))
    try:
        import carry
    finally:
        sys.path.remove(str(ROOT / "scripts" / "gpu"))
    assert carry.orbit_requirements_uncovered() == []
