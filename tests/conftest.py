"""Shared fixtures: tiny models built offline once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

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


@pytest.fixture
def one_torch_thread():
    """In-process engines run on one torch thread, as the engine process does: on a shared 2-core
    machine two OpenMP threads fighting another process's work slow every op down many times."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
