"""Engine backends behind one protocol (orbit/engine/base.py), and the pool that runs N of them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from orbit.config import AdapterConfig, EngineConfig
from orbit.engine.base import Engine
from orbit.engine.pool import EnginePool


def start_engine(cfg: EngineConfig, model: Path, seed: int, adapter: AdapterConfig | None = None,
                 call_timeout_s: float | None = None, device: str | None = None, load_delay_s: float = 0.0) -> Engine:
    """Start one engine of the backend a recipe's `engine` section names and return its client.

    `adapter` sizes what SGLang must fix at start (max LoRA rank, target modules; no LoRA for OFT);
    without it the SGLang backend accepts LoRA rank <= 8 on all seven projections.
    `call_timeout_s`: an engine that answers no control call for this long is hung (EngineDeadError).
    `device`: this engine's device (default `cfg.device`). `load_delay_s`: a test hook (embedded
    engine only) that makes every adapter load this much slower.
    """
    device = device or cfg.device
    if cfg.backend == "embedded":
        from orbit.engine.embedded import start_embedded_engine

        return start_embedded_engine(
            model, max_running=cfg.max_running, dtype=cfg.dtype, device=device, threads=cfg.threads, seed=seed,
            slots=cfg.slots, load_delay_s=load_delay_s,
            **({"call_timeout_s": call_timeout_s} if call_timeout_s else {}),
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
            model, max_running=cfg.max_running, dtype=cfg.dtype, device=device, threads=cfg.threads,
            seed=seed, slots=cfg.slots, **lora,
        )
    raise ValueError(f"engine.backend: {cfg.backend!r} is not available (allowed: 'embedded', 'sglang')")


def start_pool(cfg: EngineConfig, model: Path, seed: int, adapter: AdapterConfig | None = None,
               call_timeout_s: float | None = None, timeline=None, on_warning: Callable[[str], None] | None = None,
               load_delays: list[float] | None = None) -> EnginePool:
    """Start the recipe's `engine.replicas` engines (one per device) as one pool. If one fails to
    start, the ones already started are stopped and the error goes on."""
    engines: list[Engine] = []
    try:
        for i, device in enumerate(cfg.engine_devices()):
            delay = load_delays[i] if load_delays else 0.0
            engines.append(start_engine(cfg, model, seed + i, adapter, call_timeout_s, device, delay))
    except BaseException:
        for engine in engines:
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001 - the start-up error is the one to report
                pass
        raise
    return EnginePool(engines, [cfg.max_running] * len(engines), timeline=timeline, on_warning=on_warning)
