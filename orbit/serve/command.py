"""`orbit serve RECIPE`: the recipe's engines for its base model, the Tinker API in front of them
and a trainer beside them, until Ctrl-C or SIGTERM. A recipe of just `model:` and `engine:` is
enough (`trainer.threads` and `trainer.dtype` are the trainer's; `adapter.r` and
`adapter.target_modules` size what an SGLang engine can load)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from rich.console import Console

from orbit.config import Recipe
from orbit.engine import EngineStarter, start_engines, stop_engines
from orbit.host.net import ThreadServer
from orbit.run.placement import colocate
from orbit.serve.app import app
from orbit.serve.clients import ATTN, MLP, UNEMBED
from orbit.serve.samplers import Sampler
from orbit.serve.service import EngineLimits, Service


def serve(
    recipe: Recipe, written: str, host: str, port: int | None, directory: Path, console: Console
) -> None:
    """Serve until interrupted; `written`: the recipe's `model:` as the user wrote it (a client may
    name the base model so, or by its absolute path)."""
    with serving(recipe, directory, {written}, host, port, console.print) as (url, _):
        console.print(
            f"serving the Tinker API for {recipe.model.resolve()} at {url} "
            f"(TINKER_BASE_URL={url}); checkpoints in {directory}; Ctrl-C stops it",
            highlight=False,
        )
        _wait_for_a_stop()


@contextmanager
def serving(
    recipe: Recipe,
    directory: Path,
    names: Iterable[str] = (),
    host: str = "127.0.0.1",
    port: int | None = None,
    say: Callable[[str], object] = print,
) -> Iterator[tuple[str, Service]]:
    """The recipe's engines, the service and its HTTP server, stopped on leaving the block: (its
    address, the service). `names`: what clients may call the base model besides the recipe's
    `model:` and its absolute path."""
    from transformers import AutoTokenizer

    torch.set_num_threads(recipe.trainer.threads)
    engine_cfg, note = colocate(recipe, 1)
    if note:
        say(note)
    # A client may adapt every projection and the output projection (train_unembed): SGLang fixes
    # what it can load when it starts, so its engines are started for all of them, up to the
    # recipe's rank.
    every = recipe.adapter.model_copy(update={"target_modules": [*ATTN, *MLP, *UNEMBED]})
    starter = EngineStarter(
        engine_cfg,
        recipe.model,
        recipe.seed,
        every,
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
            {*names, str(recipe.model), str(model)},
            sampler,
            directory,
            dtype=recipe.trainer.dtype,
            max_context=info.max_context,
            vocab_size=info.vocab_size,
            limits=limits(recipe),
        )
        server = ThreadServer(app(service), host, port, name="orbit serve").start()
        yield server.url, service
    finally:
        if server is not None:
            server.stop()
        if service is not None:
            service.close()
        stop_engines(engines)


def limits(recipe: Recipe) -> EngineLimits:
    """What the recipe's engines can load: SGLang fixes the largest LoRA rank when it starts."""
    return EngineLimits() if recipe.engine.backend == "embedded" else EngineLimits(recipe.adapter.r)


def _wait_for_a_stop() -> None:
    """Until Ctrl-C (KeyboardInterrupt) or SIGTERM."""
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):
            pass
    finally:
        signal.signal(signal.SIGTERM, previous)
