"""Stand-in submodule of sgl_kernel: `is_arch_support_pdl` (the Triton attention backend asks it at
import) says no, other names raise when called (__init__.py)."""

from sgl_kernel._missing import module_getattr


def is_arch_support_pdl() -> bool:
    """Programmatic dependent launch: a feature of the real kernels, not of these."""
    return False


__getattr__ = module_getattr(__name__)
