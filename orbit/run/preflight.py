"""Before any compute: everything a recipe names outside itself is checked here, and
`engine.backend: auto` becomes a concrete backend.

`preflight(recipe)` returns a `Checked` recipe, the value a run reads: the recipe with its backend
resolved (what the run directory's recipe.yaml records) and the lines to tell the user about it.
Each problem is a RecipeError naming the field: a model directory without weights, a tokenizer or an
architecture the engine and the trainer run; an OFT block size that does not divide a target; a task
that does not import or a dataset row that is bad; devices that do not exist; SGLang or a tracker
that is not installed; an API key variable that is not set.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from orbit.config import EngineConfig, Recipe, RecipeError, TaskConfig
from orbit.config.task import JsonlTaskConfig, MathTaskConfig, VerifiersTaskConfig
from orbit.engine.sglang.install import INSTALL_HINT, sglang_problem
from orbit.engine.spec import SpecError, read_spec
from orbit.run.placement import check_devices, choose_backend

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class Checked:
    """A recipe that passed the preflight: its backend is concrete."""

    recipe: Recipe
    # what the user is told before the run (the backend auto chose, and why)
    notes: tuple[str, ...] = ()


def preflight(recipe: Recipe) -> Checked:
    """Every check of this module, in the order a user would fix them; the recipe with its backend
    resolved."""
    recipe = recipe.model_copy(deep=True)
    note = resolve_backend(recipe.engine)
    check_installed(recipe)
    check_devices(recipe)
    check_model(recipe)
    check_oft_block_size(recipe)
    check_task(recipe.task)
    check_sglang_args(recipe)
    return Checked(recipe, (note,) if note else ())


def check_sglang_args(recipe: Recipe) -> None:
    """`engine.sglang_args` against SGLang's own parser (orbit/engine/sglang/args.py); set for an
    engine that is not SGLang, they are refused."""
    args = recipe.engine.sglang_args
    if not args:
        return
    if recipe.engine.backend not in ("sglang", "sglang-server") or recipe.engine.servers:
        raise RecipeError(
            "engine.sglang_args: for the SGLang engines Orbit starts (engine.backend sglang or "
            "sglang-server without engine.servers), not "
            f"{recipe.engine.backend!r}{' with attached servers' if recipe.engine.servers else ''}"
        )
    from orbit.engine.sglang.args import check

    problems = check(args, on_cpu="cpu" in recipe.engine.engine_devices())
    if problems:
        raise RecipeError("\n".join(problems))


def resolve_backend(cfg: EngineConfig) -> str | None:
    """`engine.backend: auto` becomes a concrete backend here; returns the one line `orbit train`
    and `orbit bench` print about it (None when the recipe named one)."""
    if cfg.backend != "auto":
        return None
    if cfg.servers:
        cfg.backend, why = "sglang-server", "engine.servers are given"
    else:
        cfg.backend, why = choose_backend(
            cfg.engine_devices(), sglang_installed=sglang_problem() is None
        )
    return f"engine: {cfg.backend} (engine.backend auto: {why})"


def check_installed(recipe: Recipe) -> None:
    """SGLang must be installed here to run in-process or to start servers (attaching needs only
    HTTP); an API key's variable must be set; the trackers must be installed."""
    backend = recipe.engine.backend
    if backend == "sglang" or (backend == "sglang-server" and recipe.engine.servers is None):
        problem = sglang_problem()
        if problem is not None:
            raise RecipeError(
                f"engine.backend: {backend!r} cannot run: {problem}. Install it with: "
                f"{INSTALL_HINT}"
            )
    key = recipe.engine.api_key_env
    if key is not None and not os.environ.get(key):
        raise RecipeError(
            f"engine.api_key_env: the environment variable {key} is not set (it must hold the "
            "servers' --api-key)"
        )
    from orbit.run.trackers import tracker_problem

    for tracker in recipe.logging:
        problem = tracker_problem(tracker)
        if problem is not None:
            raise RecipeError(f"logging: {tracker!r} cannot run: {problem}")


def check_model(recipe: Recipe) -> None:
    """The model directory: a Hugging Face checkpoint with weights, a tokenizer and an architecture
    the engine and the trainer can run. Each problem is one line naming the path."""
    model = recipe.model
    if not model.is_dir():
        raise RecipeError(
            f"model: no such directory {str(model)!r} (build one with `orbit model tiny DIR`, or "
            "import one with `orbit model import SRC DIR`)"
        )
    if not (model / "config.json").exists():
        raise RecipeError(
            f"model: {str(model)!r} has no config.json (expected a Hugging Face checkpoint)"
        )
    try:
        spec, raw = read_spec(model)
    except SpecError as err:
        raise RecipeError(f"model: {err}") from None
    if not any((model / name).exists() for name in WEIGHT_FILES):
        raise RecipeError(
            f"model: {str(model)!r} has no weights (expected {' or '.join(WEIGHT_FILES)})"
        )
    if not any((model / name).exists() for name in TOKENIZER_FILES):
        raise RecipeError(
            f"model: {str(model)!r} has no tokenizer (expected {' or '.join(TOKENIZER_FILES)})"
        )
    if recipe.engine.backend == "embedded":
        from orbit.engine.embedded.model import unsupported

        problem = unsupported(spec, raw)
        if problem is not None:
            raise RecipeError(
                f"model: {str(model)!r}: {problem} (SGLang runs more: engine.backend: sglang)"
            )
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if spec.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise RecipeError(
            f"model: {str(model)!r} is a {spec.model_type!r} model, which the trainer "
            "(transformers' AutoModelForCausalLM) cannot load"
        )


def check_oft_block_size(recipe: Recipe) -> None:
    """OFT splits each target's input into blocks: the block size must divide every width."""
    adapter = recipe.adapter
    if adapter.type != "oft":
        return
    spec, _ = read_spec(recipe.model)
    sizes = [spec.in_features(t) for t in adapter.target_modules]
    if all(n % adapter.oft_block_size == 0 for n in sizes):
        return
    allowed = [b for b in range(2, min(sizes) + 1) if all(n % b == 0 for n in sizes)]
    raise RecipeError(
        f"adapter.oft_block_size: {adapter.oft_block_size} does not divide the input width of "
        f"every target ({dict(zip(adapter.target_modules, sizes, strict=True))}); allowed: "
        f"{allowed}"
    )


def check_verifiers(python: str, taskset: str) -> None:
    """The environment's interpreter can run and a taskset file exists (loading it is the bridge's,
    at start)."""
    exe = Path(python)
    if not (exe.is_file() and os.access(exe, os.X_OK)):
        raise RecipeError(
            f"task.python: {python!r} is not a Python to run (make verifiers sets up "
            ".venv-verifiers/bin/python)"
        )
    if taskset.endswith(".py") and not Path(taskset).is_file():
        raise RecipeError(f"task.taskset: no file {taskset!r}")


def check_task(task: TaskConfig) -> None:
    """What can be checked without the model: a user task imports, a dataset's rows are valid (every
    row of a math dataset has its fields and a gold answer math-verify can read)."""
    from orbit.tasks.common import DatasetError
    from orbit.tasks.jsonl import load_rows
    from orbit.tasks.loader import TaskLoadError, resolve_factory
    from orbit.tasks.math import load_problems
    from orbit.tasks.verify import MathChecker

    key = "name"
    try:
        if not task.is_builtin:
            resolve_factory(task.name)
        if task.name == "agent":  # its entry imports and is async, its data loads (no model needed)
            from orbit.tasks.agent import AgentTask

            key = "data"
            try:
                AgentTask(None, **task.options())
            except TaskLoadError as err:
                raise RecipeError(f"task.entry: {err}") from None
            except DatasetError:
                raise
            except ValueError as err:
                raise RecipeError(str(err)) from None
        if isinstance(task, VerifiersTaskConfig):
            check_verifiers(task.python, task.taskset)
        if isinstance(task, JsonlTaskConfig | MathTaskConfig):
            for key in ("path", "eval_path"):
                path = task.path if key == "path" else task.eval_path
                if path is None:
                    continue
                if isinstance(task, JsonlTaskConfig):
                    load_rows(path)
                    continue
                checker = MathChecker()
                try:
                    load_problems(
                        path,
                        task.question_field or "question",
                        task.answer_field or "answer",
                        checker,
                    )
                finally:
                    checker.close()
    except TaskLoadError as err:
        raise RecipeError(f"task.name: {err}") from None
    except DatasetError as err:
        raise RecipeError(f"task.{key}: {err}") from None


def stop_token_ids(tokenizer, stop: list[str]) -> tuple[int, ...]:
    """eos plus the recipe's stop strings, each of which must be exactly one token."""
    ids = [tokenizer.eos_token_id]
    for text in stop:
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) != 1:
            raise RecipeError(
                f"rollout.stop: {text!r} is {len(encoded)} tokens {encoded} for this tokenizer; "
                "each stop string must be exactly one token"
            )
        ids.append(encoded[0])
    return tuple(ids)
