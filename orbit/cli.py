"""The `orbit` command line: train, eval, bench, recipe check, model tiny."""

from __future__ import annotations

import signal
import sys
from enum import Enum
from pathlib import Path

import typer
from rich.console import Console

from orbit.config import RecipeError, load_recipe
from orbit.modes import MODE_NAMES

app = typer.Typer(add_completion=False, no_args_is_help=True, help="RL post-training of LoRA/OFT adapters.")
recipe_app = typer.Typer(no_args_is_help=True, help="Recipe tools.")
model_app = typer.Typer(no_args_is_help=True, help="Models built offline.")
app.add_typer(recipe_app, name="recipe")
app.add_typer(model_app, name="model")
console = Console()
err_console = Console(stderr=True, soft_wrap=True)

ModeChoice = Enum("ModeChoice", {m: m for m in MODE_NAMES}, type=str)
EngineChoice = Enum("EngineChoice", {"embedded": "embedded", "sglang": "sglang"}, type=str)
SizeChoice = Enum("SizeChoice", {"tiny": "tiny", "small": "small"}, type=str)
ArchChoice = Enum("ArchChoice", {"llama": "llama", "qwen2": "qwen2"}, type=str)
WarmTaskChoice = Enum("WarmTaskChoice", {"arith": "arith", "zorplex": "zorplex"}, type=str)


def _fail(message: str, code: int = 2) -> None:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


@app.command()
def train(
    recipe: Path = typer.Argument(..., help="recipe YAML"),
    mode: ModeChoice | None = typer.Option(None, help="loop mode (overrides the recipe)"),
    steps: int | None = typer.Option(None, help="train steps (overrides trainer.steps)"),
    out: Path | None = typer.Option(None, help="run directory (overrides out)"),
    engine: EngineChoice | None = typer.Option(None, help="engine backend (overrides engine.backend)"),
    resume: Path | None = typer.Option(None, help="continue the run in this directory"),
    quiet: bool = typer.Option(False, help="no live view"),
) -> None:
    """Train an adapter with RL: `orbit train recipes/tiny.yaml --mode double-buffer`."""
    from orbit.run import Interrupted
    from orbit.run import train as run_train
    from orbit.tasks import TaskError

    # Ctrl-C must stop a run cleanly even when started with SIGINT ignored (e.g. a background job).
    signal.signal(signal.SIGINT, signal.default_int_handler)

    overrides = {
        "mode": mode.value if mode else None,
        "trainer.steps": steps,
        "out": str(resume or out) if (resume or out) else None,
        "engine.backend": engine.value if engine else None,
    }
    try:
        r = load_recipe(recipe, overrides)
    except RecipeError as err:
        _fail(f"bad recipe {recipe}:\n{err}")
    try:
        result = run_train(r, resume=resume is not None, live=not quiet and sys.stdout.isatty(), console=console)
    except RecipeError as err:
        _fail(str(err))
    except TaskError as err:
        _fail(f"the task failed: {err}", code=1)
    except Interrupted as err:
        err_console.print(f"[bold yellow]{err}[/]", highlight=False)
        raise typer.Exit(130) from None
    console.print(
        f"done: {result.steps_done} steps in {result.seconds:.1f}s → {result.run_dir} "
        f"(metrics.jsonl, timeline.jsonl, adapter/)"
    )


@app.command()
def bench(
    recipe: Path = typer.Argument(Path("bench/five-panel.yaml"), help="workload recipe"),
    engine: EngineChoice | None = typer.Option(None, help="engine backend (overrides engine.backend)"),
    steps: int = typer.Option(8, help="measured steps per mode"),
    warmup: int = typer.Option(2, help="warm-up steps per mode, excluded from the figures"),
    out: Path = typer.Option(Path("runs/bench"), help="output directory"),
) -> None:
    """Run the five modes on one workload: summary.json, a table and panels.png."""
    from orbit.bench import run_bench

    overrides = {"engine.backend": engine.value if engine else None}
    try:
        r = load_recipe(recipe, overrides)
        result = run_bench(r, out, steps=steps, warmup=warmup, console=console)
    except RecipeError as err:
        _fail(f"bad bench arguments ({recipe}):\n{err}")
    console.print(f"wrote {result.out / 'summary.json'} and {result.out / 'panels.png'}")


@recipe_app.command("check")
def recipe_check(file: Path = typer.Argument(..., help="recipe YAML")) -> None:
    """Validate a recipe without running anything."""
    try:
        r = load_recipe(file)
        task = _check_task_builds(r)
    except RecipeError as err:
        _fail(f"bad recipe {file}:\n{err}")
    console.print(f"ok: {file} (mode {r.mode}, {r.adapter.type}, engine {r.engine.backend}, task {task})")


def _check_task_builds(r) -> str:
    """Build the recipe's task with the model's tokenizer (one-token markers, templates, the factory)."""
    from transformers import AutoTokenizer

    from orbit.tasks import make_task

    task = make_task(r.task, AutoTokenizer.from_pretrained(r.model))
    return getattr(task, "name", r.task.name)


@model_app.command("tiny")
def model_tiny(
    out: Path = typer.Argument(..., help="output directory"),
    arch: ArchChoice = typer.Option(ArchChoice.llama, help="architecture"),
    seed: int = typer.Option(0, help="init seed"),
    size: SizeChoice = typer.Option(SizeChoice.tiny, help="tiny (tests, demo) or small (~3M params, bench)"),
    task: WarmTaskChoice | None = typer.Option(
        None, help="warm start: a short supervised pass on this task, so RL starts from partial competence"
    ),
) -> None:
    """Build a tiny random-init model with a locally trained tokenizer (no hub access).

    With --task, the model gets the task tokenizer and a deterministic supervised warm start,
    cached under $ORBIT_CACHE (default .cache)/warm."""
    if task is not None:
        from orbit.warmstart import warm_start

        path = warm_start(out, task.value, arch=arch.value, seed=seed, size=size.value,
                          log=lambda m: console.print(m, highlight=False))
        console.print(f"{size.value} {arch.value} model warm-started on {task.value} written to {path}")
        return
    from orbit.tiny import build_tiny_model

    path = build_tiny_model(out, arch=arch.value, seed=seed, size=size.value)
    console.print(f"{size.value} {arch.value} model written to {path}")


@app.command("eval")
def eval_cmd(
    target: Path = typer.Argument(..., help="run directory (base vs trained), adapter directory, or model directory"),
    task: str | None = typer.Option(
        None, help="task: a built-in name, module:factory or a .jsonl file (default: the run's recipe task)"
    ),
    n: int = typer.Option(200, help="held-out prompts"),
    model: Path | None = typer.Option(None, help="base model directory (default: from the run's recipe)"),
    max_new_tokens: int | None = typer.Option(None, help="tokens per model turn (default: the recipe's)"),
    seed: int = typer.Option(0, help="which held-out prompts (the eval split's stream seed)"),
    threads: int = typer.Option(1, help="engine threads"),
) -> None:
    """Held-out accuracy, format rate, turns, tool calls and failure modes; writes eval.json."""
    from orbit.eval import resolve_target, run_eval
    from orbit.tasks import TaskError

    try:
        t = resolve_target(target, task, model, max_new_tokens)
        run_eval(t, n=n, seed=seed, threads=threads, console=console)
    except RecipeError as err:
        _fail(str(err))
    except TaskError as err:
        _fail(f"the task failed: {err}", code=1)
    console.print(f"wrote {t.out / 'eval.json'}")


if __name__ == "__main__":
    app()
