"""`orbit serve RECIPE`: the recipe's engines for its base model (and for each of `serve.models`),
the Tinker API in front of them and a trainer beside them, until Ctrl-C or SIGTERM. A recipe of
just `model:` and `engine:` is enough (`trainer.device`, `threads` and `dtype` are the trainer's;
`adapter.r` and `adapter.target_modules` size what an SGLang engine can load). Its state is in a
database (store.py) in `--dir` unless `--db` names another; `--keys` makes it a service for several
tenants."""

from __future__ import annotations

import ipaddress
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from orbit.config import Recipe, RecipeError
from orbit.engine import Engine, EngineStarter, start_engines, stop_engines
from orbit.host.net import ThreadServer
from orbit.host.threads import compute_threads
from orbit.run.placement import colocate
from orbit.run.preflight import preflight
from orbit.serve.app import MAX_BODY, app
from orbit.serve.bases import EngineLimits, Engines
from orbit.serve.clients import ATTN, MLP, UNEMBED
from orbit.serve.keys import Keys
from orbit.serve.samplers import Sampler
from orbit.serve.service import PACK_TOKENS, Quotas, Service
from orbit.serve.store import Store, default_url, instance
from orbit.train.shared import SharedBase


@dataclass(frozen=True)
class Options:
    """How `orbit serve` serves: where it listens, keeps its state, whose keys it takes."""

    host: str = "127.0.0.1"
    port: int | None = None
    directory: Path = Path("runs/serve")
    db: str | None = None  # a database URL; None: SQLite in `directory`
    keys: Keys = field(default_factory=Keys)
    quotas: Quotas = field(default_factory=Quotas)
    max_body: int = MAX_BODY
    # tokens a pack of clients' forward(-backward) requests may hold (training.py); 0: one a turn
    pack_tokens: int = PACK_TOKENS

    def check(self) -> None:
        """ValueError when the service would be open to other machines without keys."""
        if not _loopback(self.host) and not self.keys.required:
            raise ValueError(
                f"--host {self.host}: other machines could reach the service; give it --keys FILE"
            )


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(
    recipe: Recipe, names: set[str], options: Options, console: Console, watch: bool = False
) -> None:
    """Serve until interrupted; `names`: the recipe's `model:` as the user wrote it and the names
    `--name` gave (a client may name the base model so, or by its absolute path). `watch`: the
    service's page too (page.py)."""
    options.check()
    with serving(recipe, options, names, console.print) as (url, service):
        page = None
        if watch:
            from orbit.serve.page import watch as watch_page

            page = watch_page(service)
            console.print(f"the service's page: {page.url}", highlight=False)
        failed, lost = service.recovered
        if failed or lost:
            console.print(
                f"restarted on {options.directory}: {failed} requests that were running failed, "
                f"{lost} training clients lost (their checkpoints stand)",
                highlight=False,
            )
        keys = "API keys from --keys" if options.keys.required else "any key (one tenant)"
        models = ", ".join(str(base.model) for base in service.bases)
        console.print(
            f"serving the Tinker API for {models} at {url} "
            f"(TINKER_BASE_URL={url}); {keys}; state in {options.directory}; Ctrl-C stops it",
            highlight=False,
        )
        try:
            _wait_for_a_stop()
        finally:
            if page is not None:
                page.stop()


@contextmanager
def serving(
    recipe: Recipe,
    options: Options,
    names: Iterable[str] = (),
    say: Callable[[str], object] = print,
) -> Iterator[tuple[str, Service]]:
    """The engines of the recipe's base models (its `model:` and `serve.models`), the service and
    its HTTP server, stopped on leaving the block: (its address, the service). `names`: what
    clients may call the recipe's `model:` besides its `serve.names` and its path."""
    compute_threads(recipe.trainer.threads)
    bases = served(recipe, names)  # every base checked before any engine starts
    directory = options.directory
    directory.mkdir(parents=True, exist_ok=True)
    store = Store(options.db or default_url(directory), instance(directory))
    started: list[list[Engine]] = []
    service = None
    server = None
    try:
        # one after another: on a shared GPU each base's engines are planned (colocate) on the
        # memory the ones before left
        engines = [_start(base, base_names, started, say) for base, base_names in bases]
        service = Service(
            engines,
            directory,
            store,
            quotas=options.quotas,
            threads=recipe.trainer.threads,
            pack_tokens=options.pack_tokens,
        )
        api = app(service, options.keys, options.max_body)
        server = ThreadServer(api, options.host, options.port, name="orbit serve").start()
        yield server.url, service
    finally:
        if server is not None:
            server.stop()
        if service is not None:
            service.close()
        for pool in started:
            stop_engines(pool)
        store.close()


def served(recipe: Recipe, names: Iterable[str] = ()) -> list[tuple[Recipe, set[str]]]:
    """The recipe's base models, each checked (preflight: serve.models' are named by their place)
    with every name it has: as written, its absolute path, and the names given (`names`: the first
    one's besides its serve.names). RecipeError for a checkpoint served twice or a name given to
    two."""
    if len(recipe.trainer.rank_devices()) > 1:
        raise RecipeError(
            f"trainer.devices: {recipe.trainer.rank_devices()}; orbit serve trains every client on "
            "one device (trainer.device)"
        )
    bases: list[tuple[Recipe, set[str]]] = []
    for i, (base, given) in enumerate(recipe.bases()):
        where = "" if i == 0 else f"serve.models[{i - 1}]."
        if i:
            try:
                base = preflight(base).recipe
            except RecipeError as err:
                raise RecipeError(f"{where}{err}") from None
        model = base.model.resolve()
        if any(b.model.resolve() == model for b, _ in bases):
            raise RecipeError(
                f"{where}model: {model} is served already; a checkpoint is one base model (give "
                "it more names in its serve.names or serve.models[i].names)"
            )
        extra = set(names) if i == 0 else set()
        mine = {*given, *extra, str(base.model), str(model)}
        for earlier, (other, theirs) in enumerate(bases):
            both = sorted(mine & theirs)
            if both:
                first = (
                    "model: (its names, --name)" if earlier == 0 else f"serve.models[{earlier - 1}]"
                )
                raise RecipeError(
                    f"{where}names: {both[0]!r} is also a name of {first} ({other.model}); a name "
                    "names one model"
                )
        bases.append((base, mine))
    return bases


def _start(
    recipe: Recipe, names: set[str], started: list[list[Engine]], say: Callable[[str], object]
) -> Engines:
    """One base model's engines (added to `started` once up, for the caller to stop)."""
    from transformers import AutoTokenizer

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
    engines = start_engines(starter)
    started.append(engines)
    info = engines[0].info
    # the trainer's copy now, before the next base's engines are planned on what memory is left
    shared = SharedBase(model, recipe.trainer.dtype, recipe.trainer.rank_devices()[0])
    return Engines(
        model,
        names,
        Sampler(engines, engine_cfg.slots, lambda ids: tokenizer.decode(ids)),
        info.max_context,
        info.vocab_size,
        shared,
        limits(recipe),
    )


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
