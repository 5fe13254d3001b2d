"""Shared fixtures: tiny models built offline once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from orbit.tiny import build_tiny_model

_CACHE = Path(__file__).resolve().parent.parent / ".cache" / "tiny"


def tiny_model(arch: str = "llama", seed: int = 0) -> Path:
    """Path of a tiny checkpoint, built on first use (deterministic, so safe to cache)."""
    path = _CACHE / f"{arch}-s{seed}"
    if not (path / "model.safetensors").exists():
        build_tiny_model(path, arch=arch, seed=seed)
    return path


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_qwen2() -> Path:
    return tiny_model("qwen2")


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_any(request) -> Path:
    return tiny_model(request.param)
