"""Engine backends behind one protocol (orbit/engine/base.py)."""

from __future__ import annotations

from pathlib import Path

from orbit.config import EngineConfig
from orbit.engine.base import Engine


def start_engine(cfg: EngineConfig, model: Path, seed: int) -> Engine:
    """Start the backend a recipe's `engine` section names and return its client."""
    if cfg.backend == "embedded":
        from orbit.engine.embedded import start_embedded_engine

        return start_embedded_engine(
            model, max_running=cfg.max_running, dtype=cfg.dtype, device=cfg.device,
            threads=cfg.threads, seed=seed,
        )
    raise ValueError(f"engine.backend: {cfg.backend!r} is not available (allowed: 'embedded')")
