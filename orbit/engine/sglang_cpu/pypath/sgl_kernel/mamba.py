"""Stub of `sgl_kernel.mamba` (Orbit CPU shim, see sgl_kernel/__init__.py): every name raises
NotImplementedError when called (GDN/KDA/Mamba layers need the real CPU kernels)."""

from sgl_kernel import _stub


def __getattr__(name: str):
    if name.startswith("_"):
        raise AttributeError(name)
    fn = _stub(f"sgl_kernel.mamba.{name}")
    globals()[name] = fn
    return fn
