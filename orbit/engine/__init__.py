"""Engine backends behind one protocol (orbit/engine/base.py), and the pool that runs N of them."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from orbit.config import AdapterConfig, EngineConfig
from orbit.engine.base import Engine
from orbit.engine.pool import EnginePool


def start_engine(
    cfg: EngineConfig,
    model: Path,
    seed: int,
    adapter: AdapterConfig | None = None,
    call_timeout_s: float | None = None,
    device: str | None = None,
    server: str | None = None,
    truncated: bool = False,
) -> Engine:
    """Start one engine of the backend a recipe's `engine` section names and return its client.

    `adapter` sizes what SGLang must fix at start (max LoRA rank, target modules; no LoRA for OFT);
    without it the SGLang backend accepts LoRA rank <= 8 on all seven projections.
    `call_timeout_s`: an engine that answers no control call for this long is hung
    (EngineDeadError). `device`: this engine's device (default `cfg.device`). `server`: the URL of
    the running SGLang server this engine attaches to (sglang-server; None: start one). `truncated`:
    rollouts sample with top-k/top-p (a server must then return sampling masks as wide as the
    vocabulary).
    """
    device = device or cfg.device
    if cfg.backend == "embedded":
        from orbit.engine.embedded import start_embedded_engine
        from orbit.engine.embedded.process import CALL_TIMEOUT_S

        return start_embedded_engine(
            model,
            max_running=cfg.max_running,
            max_context=cfg.max_context,
            dtype=cfg.dtype,
            device=device,
            threads=cfg.threads,
            seed=seed,
            slots=cfg.slots,
            call_timeout_s=call_timeout_s or CALL_TIMEOUT_S,
        )
    if adapter is None:
        lora: dict = {}
    elif adapter.type == "lora":
        lora = {"max_lora_rank": adapter.r, "lora_target_modules": tuple(adapter.target_modules)}
    else:  # OFT on SGLang goes as merged weights (orbit/push/phases.py): no LoRA machinery needed
        lora = {"lora": False}
    if cfg.backend == "sglang":
        from orbit.engine.sglang import start_sglang_engine

        return start_sglang_engine(
            model,
            max_running=cfg.max_running,
            dtype=cfg.dtype,
            device=device,
            threads=cfg.threads,
            seed=seed,
            slots=cfg.slots,
            context_length=cfg.max_context,
            mem_fraction=cfg.mem_fraction,
            tp=cfg.tp,
            extra=tuple(cfg.sglang_args.items()),
            **lora,
        )
    if cfg.backend == "sglang-server":
        from orbit.engine.sglang.process import SGLangOptions
        from orbit.engine.sglang.server import start_server_engine

        opts = SGLangOptions(
            max_running=cfg.max_running,
            dtype=cfg.dtype,
            device=device,
            threads=cfg.threads,
            seed=seed,
            slots=cfg.slots,
            context_length=cfg.max_context,
            extra=tuple(cfg.sglang_args.items()),
            **lora,
        )
        key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
        return start_server_engine(
            model,
            opts,
            url=server,
            api_key=key,
            api_key_env=cfg.api_key_env,
            adapter_dir=cfg.adapter_dir,
            adapter_transport=cfg.adapter_transport,
            mem_fraction=cfg.mem_fraction,
            tp=cfg.tp,
            timeout_s=call_timeout_s or 600.0,
            truncated=truncated,
            threads=cfg.threads,
            host=cfg.host,
        )
    raise ValueError(
        f"engine.backend: {cfg.backend!r} is not available (allowed: 'embedded', 'sglang', "
        "'sglang-server')"
    )


class EngineStarter:
    """Starts engine `i` of a recipe's engines (its device, its server): at the
    start of a run, and again when one that died is brought back (orbit/run/revive.py)."""

    def __init__(
        self,
        cfg: EngineConfig,
        model: Path,
        seed: int,
        adapter: AdapterConfig | None = None,
        call_timeout_s: float | None = None,
        truncated: bool = False,
    ) -> None:
        self.cfg, self.model, self.seed, self.adapter = cfg, model, seed, adapter
        self.call_timeout_s, self.truncated = call_timeout_s, truncated
        self.servers: list[str | None] = [*cfg.servers] if cfg.servers else [None] * cfg.engines
        self.devices = cfg.engine_devices()
        self.attached = bool(cfg.servers)  # servers someone else runs: re-attached, never restarted

    @property
    def count(self) -> int:
        return self.cfg.engines

    def start(self, i: int) -> Engine:
        return start_engine(
            self.cfg,
            self.model,
            self.seed + i,
            self.adapter,
            self.call_timeout_s,
            self.devices[i],
            self.servers[i],
            self.truncated,
        )

    def capacities(self) -> list[int]:
        """Each engine's `max_running`: the share of requests the pool routes to it."""
        return [self.cfg.max_running] * self.count


def start_pool(
    starter: EngineStarter, timeline=None, on_warning: Callable[[str], None] | None = None
) -> EnginePool:
    """Start the recipe's engines as one pool."""
    return EnginePool(
        start_engines(starter), starter.capacities(), timeline=timeline, on_warning=on_warning
    )


def start_engines(starter: EngineStarter) -> list[Engine]:
    """Start the recipe's engines (`engine.replicas`, one per device, or one per `engine.servers`).
    If one fails to start, the ones already started are stopped and the error goes on."""
    engines: list[Engine] = []
    count = starter.count
    futures: list[Future[Engine]] = []
    try:
        if starter.cfg.backend == "sglang-server" and count > 1:
            # Servers start (or are checked) side by side: N servers take one server's start-up
            # time.
            with ThreadPoolExecutor(count) as pool:
                futures = [pool.submit(starter.start, i) for i in range(count)]
            engines.extend(f.result() for f in futures if f.exception() is None)
            if errors := [e for f in futures if (e := f.exception()) is not None]:
                raise errors[0]
        else:
            for i in range(count):
                engines.append(starter.start(i))
    except BaseException:
        # Ctrl-C while servers start: leaving the executor's block waited for each start; stop all
        stop_engines(engines or [f.result() for f in futures if f.done() and f.exception() is None])
        raise
    return engines


def stop_engines(engines: list[Engine]) -> None:
    """Shut each engine down; one that fails to stop does not keep the others running (nor hide the
    error that made the caller stop them)."""
    for engine in engines:
        try:
            engine.shutdown()
        except Exception:  # noqa: BLE001 - see above
            pass
