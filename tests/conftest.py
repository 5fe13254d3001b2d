"""Shared fixtures: tiny models built offline once per session."""

from __future__ import annotations

import os
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
# `datasets` keeps what it loads in a cache: the repository's, not the home directory (set before import)
os.environ.setdefault("HF_DATASETS_CACHE", str(_ROOT / ".cache" / "datasets"))

import pytest  # noqa: E402
import torch  # noqa: E402

from orbit.tiny import build_tiny_model  # noqa: E402

pytest_plugins = ["sglang_gate"]  # `sglang` marker: skip without sglang, fail in CI

_CACHE = _ROOT / ".cache" / "tiny"


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


@pytest.fixture(scope="session")
def tiny_qwen3() -> Path:
    return tiny_model("qwen3")


@pytest.fixture(scope="session", params=["llama", "qwen2", "qwen3"])
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


# ---- task models (orbit/warmstart.py): built once, cached under .cache/warm by code version --------


@pytest.fixture(scope="session")
def warm_arith() -> Path:
    """The tiny llama warm-started on arith (partial competence), as `orbit model tiny --task arith`."""
    from orbit.warmstart import warm_model

    return warm_model("arith", root=_CACHE.parent)


@pytest.fixture(scope="session")
def warm_zorplex() -> Path:
    from orbit.warmstart import warm_model

    return warm_model("zorplex", root=_CACHE.parent)


@pytest.fixture(scope="session")
def tiny_task_tokens() -> Path:
    """A random-init tiny llama with the task tokenizer (digits, <answer>, LOOKUP( as tokens)."""
    import hashlib

    import orbit.tiny

    version = hashlib.sha256(Path(orbit.tiny.__file__).read_bytes()).hexdigest()[:12]
    path = _CACHE.parent / "tiny-task" / f"llama-s0-{version}"
    if not (path / "model.safetensors").exists():
        build_tiny_model(path, arch="llama", seed=0, task_tokens=True)
    return path
