"""Engine backends behind one protocol (orbit/engine/base.py)."""

from __future__ import annotations

from pathlib import Path

from orbit.config import AdapterConfig, EngineConfig
from orbit.engine.base import Engine


def start_engine(cfg: EngineConfig, model: Path, seed: int, adapter: AdapterConfig | None = None,
                 call_timeout_s: float | None = None) -> Engine:
    """Start the backend a recipe's `engine` section names and return its client.

    `adapter` sizes what SGLang must fix at start (max LoRA rank, target modules; no LoRA for OFT);
    without it the SGLang backend accepts LoRA rank <= 8 on all seven projections.
    `call_timeout_s`: an engine that answers no control call for this long is hung (EngineDeadError).
    """
    if cfg.backend == "embedded":
        from orbit.engine.embedded import start_embedded_engine

        return start_embedded_engine(
            model, max_running=cfg.max_running, dtype=cfg.dtype, device=cfg.device,
            threads=cfg.threads, seed=seed, **({"call_timeout_s": call_timeout_s} if call_timeout_s else {}),
        )
    if cfg.backend == "sglang":
        from orbit.engine.sglang import start_sglang_engine

        if adapter is None:
            lora: dict = {}
        elif adapter.type == "lora":
            lora = {"max_lora_rank": adapter.r, "lora_target_modules": tuple(adapter.target_modules)}
        else:  # OFT on SGLang goes as merged weights (orbit/sync.py): no LoRA machinery needed
            lora = {"lora": False}
        return start_sglang_engine(
            model, max_running=cfg.max_running, dtype=cfg.dtype, device=cfg.device, threads=cfg.threads,
            seed=seed, **lora,
        )
    raise ValueError(f"engine.backend: {cfg.backend!r} is not available (allowed: 'embedded', 'sglang')")
