"""Stand-in submodule of sgl_kernel: every name imports and raises when called (__init__.py)."""

from sgl_kernel._missing import module_getattr

__getattr__ = module_getattr(__name__)
