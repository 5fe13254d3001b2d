"""Names a stand-in `sgl_kernel` module does not have: they import, and raise when used."""

from __future__ import annotations


class Missing:
    """A name of the real sgl_kernel: importable, an attribute chain of more of them (a scalar
    type's members), and an error naming itself when called."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"{self._qualname} is not available: the lent GPU machine runs SGLang with Orbit's "
            "stand-in sgl_kernel (scripts/gpu/standins); this path needs the real kernel"
        )

    def __getattr__(self, name: str) -> Missing:
        if name.startswith("__"):
            raise AttributeError(name)
        return Missing(f"{self._qualname}.{name}")

    def __repr__(self) -> str:
        return f"<missing {self._qualname}>"


def module_getattr(module: str):
    """A module's `__getattr__` that gives `Missing` for any public name it does not define."""

    def getattr_(name: str) -> Missing:
        if name.startswith("_"):
            raise AttributeError(name)
        return Missing(f"{module}.{name}")

    return getattr_
