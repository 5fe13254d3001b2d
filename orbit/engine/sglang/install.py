"""Whether SGLang can run in this Python environment: the one release the backend speaks, and how to
install it. Looked up without importing sglang (that takes seconds and starts nothing useful
here)."""

from __future__ import annotations

import importlib.metadata
import importlib.util

SGLANG_VERSION = "0.5.23"  # the one SGLang release the backend is written and tested against
INSTALL_HINT = (
    "make sglang (installs it into .venv; or by hand: bash scripts/install_sglang.sh VENV && "
    "VENV/bin/pip install -c constraints.txt -e .)"
)


def sglang_problem() -> str | None:
    """Why SGLang cannot run here, or None: it must be importable and be SGLANG_VERSION."""
    try:
        found = importlib.util.find_spec("sglang") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return "sglang is not installed in this Python environment"
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "sglang is importable but has no package metadata (not a pip install)"
    if version != SGLANG_VERSION:
        return (
            f"sglang {version} is installed; Orbit's SGLang backend needs sglang {SGLANG_VERSION}"
        )
    return None
