"""`orbit serve RECIPE`: the recipe's engines for its base model, the Tinker API in front of them
and a trainer beside them, until Ctrl-C or SIGTERM. A recipe of just `model:` and `engine:` is
enough (`trainer.threads` and `trainer.dtype` are the trainer's; `adapter.r` and
`adapter.target_modules` size what an SGLang engine can load)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import torch
from rich.console import Console

from orbit.config import Recipe
from orbit.engine import EngineStarter, start_engines, stop_engines
from orbit.host.net import ThreadServer
from orbit.run.placement import colocate
from orbit.serve.app import app
from orbit.serve.samplers import Sampler
from orbit.serve.service import Service


def serve(
    recipe: Recipe, written: str, host: str, port: int | None, directory: Path, console: Console
) -> None:
    """Serve until interrupted; `written`: the recipe's `model:` as the user wrote it (a client may
    name the base model so, or by its absolute path)."""
    from transformers import AutoTokenizer

    torch.set_num_threads(recipe.trainer.threads)
    engine_cfg, note = colocate(recipe, 1)
    if note:
        console.print(note, highlight=False)
    starter = EngineStarter(
        engine_cfg,
        recipe.model,
        recipe.seed,
        recipe.adapter,
        call_timeout_s=recipe.rollout.stall_timeout_s,
        truncated=True,
    )
    model = recipe.model.resolve()
    tokenizer = AutoTokenizer.from_pretrained(model)
    directory.mkdir(parents=True, exist_ok=True)
    engines = start_engines(starter)
    service = None
    server = None
    try:
        info = engines[0].info
        sampler = Sampler(engines, engine_cfg.slots, lambda ids: tokenizer.decode(ids))
        service = Service(
            model,
            {written, str(recipe.model), str(model)},
            sampler,
            directory,
            dtype=recipe.trainer.dtype,
            max_context=info.max_context,
            vocab_size=info.vocab_size,
        )
        server = ThreadServer(app(service), host, port, name="orbit serve").start()
        console.print(
            f"serving the Tinker API for {model} at {server.url} "
            f"(TINKER_BASE_URL={server.url}); checkpoints in {directory}; Ctrl-C stops it",
            highlight=False,
        )
        _wait_for_a_stop()
    finally:
        if server is not None:
            server.stop()
        if service is not None:
            service.close()
        stop_engines(engines)


def _wait_for_a_stop() -> None:
    """Until Ctrl-C (KeyboardInterrupt) or SIGTERM."""
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):
            pass
    finally:
        signal.signal(signal.SIGTERM, previous)
