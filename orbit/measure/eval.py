"""`orbit eval`: held-out accuracy of a model, an adapter, or a run (base vs trained, side by side).

Generation is greedy through the embedded engine, over the first N prompts of the task's eval
split (disjoint from what training sees), with the same multi-turn episode logic as training
(orbit/rollout/episode.py). Slot None is the base model; the adapter goes into slot 0 from its
peft directory (adapter_model.safetensors + adapter_config.json).

Reported per model: accuracy, format rate (answer tag present), reward, average model turns and
tool calls, and the failure-mode breakdown. Written to `eval.json` (in the run directory, or in
the adapter directory) together with `eval_samples.jsonl` (every episode's text and score).
"""

from __future__ import annotations

import inspect
import itertools
import json
import time
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from orbit.config import RecipeError, TaskConfig, parse_recipe
from orbit.engine.base import Engine, SamplingParams
from orbit.measure import eval_cache
from orbit.rollout.episode import Episode, continue_episode, with_task_stops
from orbit.rollout.groups import score as score_sample
from orbit.run.preflight import check_task
from orbit.tasks import FAILURE_MODES, close_task, make_task
from orbit.tasks.base import Prompt, Score, Task, TaskError, is_agent, is_multi_turn

DEFAULT_N = 200
DEFAULT_MAX_NEW_TOKENS = 32
# what `orbit eval` writes into the target's directory (a model directory too)
REPORT, SAMPLES = "eval.json", "eval_samples.jsonl"


@dataclass
class EvalSummary:
    n: int
    accuracy: float
    format_rate: float
    reward_mean: float
    avg_turns: float
    avg_tool_calls: float
    failure_modes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass
class Target:
    """What `orbit eval` was pointed at, resolved."""

    kind: str  # "run" | "adapter" | "model"
    path: Path
    model: Path
    adapter: Path | None
    task: TaskConfig
    max_new_tokens: int
    out: Path  # where eval.json goes
    # an agent episode's bound: the run's rollout.episode_timeout_s
    episode_timeout_s: float = 300.0
    # the run's engine.max_context: the context it trained within, and the size of the engine's KV
    # pool (unset: the engine's default, up to 4096 a row; 64 rows of SmolLM2 at 4096 is 11 GB)
    max_context: int | None = None


def run_episodes(
    engine: Engine,
    task: Task,
    prompts: list[Prompt],
    sampling: SamplingParams,
    slot,
    max_context: int | None = None,
) -> list[Episode]:
    """One episode per prompt, all in flight at once; multi-turn tasks get their tool results."""
    sampling = with_task_stops(sampling, task)
    multi = is_multi_turn(task)
    episodes = [Episode(list(p.prompt_ids)) for p in prompts]
    pending = {engine.generate(e.context(), sampling, slot=slot): i for i, e in enumerate(episodes)}
    while pending:
        done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
        for fut in done:
            i = pending.pop(fut)
            episode = episodes[i]
            episode.add_turn(fut.result())
            if multi and continue_episode(task, prompts[i], episode, max_context):
                pending[engine.generate(episode.context(), sampling, slot=slot)] = i
    return episodes


def summarize(scores: list, episodes: list[Episode], seconds: float = 0.0) -> EvalSummary:
    n = len(scores)
    modes = {m: 0 for m in FAILURE_MODES}
    for s in scores:
        mode = s.info.get("failure_mode", "success" if s.info.get("correct") else "wrong_answer")
        modes[mode] = modes.get(mode, 0) + 1
    return EvalSummary(
        n=n,
        accuracy=sum(bool(s.info.get("correct")) for s in scores) / n,
        format_rate=sum(bool(s.info.get("format_ok")) for s in scores) / n,
        reward_mean=sum(s.reward for s in scores) / n,
        avg_turns=sum(e.turns for e in episodes) / n,
        avg_tool_calls=sum(
            s.info.get("tool_calls", e.tool_results) for s, e in zip(scores, episodes, strict=True)
        )
        / n,
        failure_modes=modes,
        seconds=round(seconds, 2),
    )


def run_agents(
    engine: Engine,
    task: Task,
    prompts: list[Prompt],
    sampling: SamplingParams,
    slot,
    max_context: int | None,
    timeout_s: float,
    concurrent: int = 64,
) -> tuple[list, list]:
    """An agent task's episodes through an endpoint over `engine`, `concurrent` at a time (an
    episode's timeout runs from its start, so none waits out its time behind the others); a lost
    episode scores 0."""
    from orbit.agents import AgentRunner, Endpoint, EpisodeFailed

    def submit(ids, s, episode_slot, _engine, meta):
        return engine.generate(ids, s, slot=episode_slot, meta=meta)

    results: list = [None] * len(prompts)
    tokenizer = task.tokenizer  # type: ignore[attr-defined]  # an agent task has one
    with Endpoint(tokenizer, submit, model="orbit-eval", max_context=max_context) as endpoint:
        runner = AgentRunner(endpoint, task, sampling, timeout_s)
        todo = iter(enumerate(prompts))
        running = {runner.start(p, None, slot): i for i, p in itertools.islice(todo, concurrent)}
        while running:
            done, _ = wait(list(running), return_when=FIRST_COMPLETED)
            for fut in done:
                i = running.pop(fut)
                try:
                    results[i] = fut.result()
                except EpisodeFailed as err:
                    results[i] = (
                        Episode([]),
                        Score(
                            0.0,
                            {"correct": False, "failure_mode": "lost", "error": str(err)[:2000]},
                        ),
                    )
                for j, p in itertools.islice(todo, 1):
                    running[runner.start(p, None, slot)] = j
    episodes = [r[0] if isinstance(r, tuple) else r for r in results]
    return episodes, [r[1] if isinstance(r, tuple) else r.score for r in results]


def evaluate(
    engine: Engine,
    task: Task,
    prompts: list[Prompt],
    slot,
    max_new_tokens: int,
    max_context: int | None = None,
    timeout_s: float = 300.0,
    concurrent: int = 64,
) -> tuple[EvalSummary, list[dict]]:
    """Greedy episodes on one slot (None = base), scored; the summary and one record per prompt."""
    t0 = time.time()
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    if is_agent(task):
        episodes, scores = run_agents(
            engine, task, prompts, sampling, slot, max_context, timeout_s, concurrent
        )
    else:
        episodes = run_episodes(engine, task, prompts, sampling, slot, max_context)
        scores = [
            score_sample(task, p, e.output_ids) for p, e in zip(prompts, episodes, strict=True)
        ]
    tokenizer = getattr(task, "tokenizer", None)
    records = []
    for p, e, s in zip(prompts, episodes, scores, strict=True):
        text = tokenizer.decode(e.output_ids) if tokenizer is not None else None
        records.append(
            {
                "id": p.id,
                "prompt": p.text,
                "answer": p.answer,
                "output": text,
                "output_ids": e.output_ids,
                "loss_mask": e.loss_mask,
                "turns": e.turns,
                "reward": s.reward,
                **{k: v for k, v in s.info.items() if _jsonable(v)},
            }
        )
    return summarize(scores, episodes, time.time() - t0), records


def _jsonable(v) -> bool:
    try:
        json.dumps(v)
        return True
    except TypeError:
        return False


def held_out_prompts(task: Task, n: int, seed: int = 0) -> list[Prompt]:
    """The first `n` distinct prompts of the task's eval split (fewer if the split is smaller: a
    dataset's stream cycles). RecipeError when the task has no eval split; TaskError when its
    prompts() itself fails."""
    if not has_eval_split(task):
        raise RecipeError(
            f"task {getattr(task, 'name', '?')!r} has no held-out split: its prompts(seed, split) "
            "must accept split='eval'"
        )
    seen: set[tuple[str, str]] = set()
    prompts: list[Prompt] = []
    try:
        stream = task.prompts(seed, "eval")
        for _ in range(max(20 * n, 1000)):
            p = next(stream)
            if (p.text, p.answer) not in seen:
                seen.add((p.text, p.answer))
                prompts.append(p)
            if len(prompts) >= n:
                break
    except StopIteration:
        pass
    except Exception as err:  # noqa: BLE001 - the task's own failure, named as such
        raise TaskError(
            f"task {getattr(task, 'name', '?')!r}: prompts(seed, 'eval') failed: "
            f"{type(err).__name__}: {err}"
        ) from err
    return prompts


def has_eval_split(task: Task) -> bool:
    """Whether `task.prompts` takes a split (a second positional parameter, `split`, or
    **kwargs)."""
    try:
        params = inspect.signature(task.prompts).parameters.values()
    except (TypeError, ValueError):
        return True  # not introspectable (a C callable): try it
    kinds = [p.kind for p in params]
    positional = [
        k
        for k in kinds
        if k in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    return (
        len(positional) >= 2
        or inspect.Parameter.VAR_POSITIONAL in kinds
        or any(p.name == "split" for p in params)
        or inspect.Parameter.VAR_KEYWORD in kinds
    )


# ---- resolving what to evaluate -----------------------------------------------------------------


def _read_recipe(path: Path) -> dict | None:
    f = path / "recipe.yaml"
    if not f.is_file():
        return None
    data = yaml.safe_load(f.read_text()) or {}
    return data if isinstance(data, dict) else None


def resolve_target(
    path: Path,
    task: str | None = None,
    model: Path | None = None,
    max_new_tokens: int | None = None,
) -> Target:
    """A run directory (has adapter/), an adapter directory (adapter_config.json), or a model."""
    path = Path(path)
    if (path / "adapter" / "adapter_config.json").is_file():
        kind, adapter, out, recipe = "run", path / "adapter", path, _read_recipe(path)
    elif (path / "adapter_config.json").is_file():
        kind, adapter, out, recipe = "adapter", path, path, _read_recipe(path.parent)
    elif (path / "config.json").is_file():
        kind, adapter, out, recipe = "model", None, path, None
    elif path.is_dir() and (path / "recipe.yaml").is_file():
        raise RecipeError(
            f"{path}: this run has no adapter yet (no {path / 'adapter'}/adapter_config.json)"
        )
    else:
        raise RecipeError(
            f"{path}: not a run directory (with adapter/), an adapter directory (with "
            "adapter_config.json) or a model directory (with config.json)"
        )
    if model is None:
        if kind == "model":
            model = path
        elif recipe and recipe.get("model"):
            model = Path(recipe["model"])
        else:
            assert adapter is not None  # a run's or an adapter's directory
            base = json.loads((adapter / "adapter_config.json").read_text()).get(
                "base_model_name_or_path"
            )
            if not base:
                raise RecipeError(f"{adapter}: cannot tell the base model; pass --model")
            model = Path(base)
    if not (Path(model) / "config.json").is_file():
        raise RecipeError(f"model: {str(model)!r} is not a model directory (pass --model)")
    recipe_task = (recipe or {}).get("task") or None
    task_cfg = _task_config(task, recipe_task)
    rollout = (recipe or {}).get("rollout") or {}
    if max_new_tokens is None:
        max_new_tokens = rollout.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS
    return Target(
        kind,
        path,
        Path(model),
        adapter,
        task_cfg,
        int(max_new_tokens),
        out,
        float(rollout.get("episode_timeout_s") or 300.0),
        ((recipe or {}).get("engine") or {}).get("max_context"),
    )


def _task_config(task: str | None, recipe_task: dict | None) -> TaskConfig:
    """`--task` (a name, `module:factory` or a .jsonl file) or else the run's own task; with the
    run's options when the names agree."""
    if task is None:
        if recipe_task is None:
            raise RecipeError(
                "--task: required (the target has no recipe.yaml to take the task from)"
            )
        data = recipe_task
    elif task.endswith(".jsonl"):
        data = {"name": "jsonl", "path": task}
        if recipe_task and recipe_task.get("name") == "jsonl":
            data = {**recipe_task, **data}
    elif recipe_task and recipe_task.get("name") == task:
        data = recipe_task
    else:
        data = {"name": task}
    # Validated as a recipe's task section is (field-path errors, import and dataset checks).
    recipe = parse_recipe({"model": ".", "task": data})
    check_task(recipe.task)
    return recipe.task


def _load_adapter(engine, adapter: Path) -> int:
    from safetensors.torch import load_file

    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    config = json.loads((adapter / "adapter_config.json").read_text())
    version = 1
    state = adapter / "trainer_state.json"
    if state.is_file():
        version = max(1, int(json.loads(state.read_text()).get("version", 1)))
    engine.load_adapter(0, tensors, config, version)
    return version


# ---- the command --------------------------------------------------------------------------------


def _evaluate_base(
    engine: Engine,
    task: Task,
    prompts: list[Prompt],
    target: Target,
    bounds: dict[str, Any],
    fresh: bool,
) -> tuple[EvalSummary, list[dict], Path | None]:
    """The base model's result: stored from an earlier `orbit eval` of the same model, prompts and
    code (orbit/measure/eval_cache.py), or evaluated and stored. The third item names the stored
    file when it was reused."""
    key = eval_cache.base_key(
        target.model,
        prompts,
        {**bounds, "max_new_tokens": target.max_new_tokens},
        skip=(REPORT, SAMPLES),
    )
    stored = None if fresh else eval_cache.load(key)
    if stored is not None:
        return EvalSummary(**stored["summary"]), stored["records"], eval_cache.path_for(key)
    summary, records = evaluate(engine, task, prompts, None, target.max_new_tokens, **bounds)
    eval_cache.store(key, asdict(summary), records)
    return summary, records, None


def _evaluate_target(
    target: Target,
    task: Task,
    n: int,
    seed: int,
    threads: int,
    console: Console,
    fresh_base: bool = False,
):
    """Base (unless the target is an adapter alone) and trained, on the embedded engine."""
    from orbit.engine.embedded import start_embedded_engine

    prompts = held_out_prompts(task, n, seed)
    if len(prompts) < n:
        console.print(
            f"note: the held-out split has only {len(prompts)} distinct prompts; evaluating those"
        )
        n = len(prompts)
    running = min(n, 64)
    engine = start_embedded_engine(
        target.model,
        max_running=running,
        threads=threads,
        seed=seed,
        max_context=target.max_context,
    )
    results, samples = {}, {}
    version, cached = None, None
    try:
        bounds: dict[str, Any] = {
            "max_context": engine.info.max_context,
            "timeout_s": target.episode_timeout_s,
            "concurrent": running,
        }
        if target.kind != "adapter":
            results["base"], samples["base"], cached = _evaluate_base(
                engine, task, prompts, target, bounds, fresh_base
            )
            if cached is not None:
                console.print(f"base: the stored result {cached} (--fresh-base evaluates again)")
        if target.adapter is not None:
            version = _load_adapter(engine, target.adapter)
            results["trained"], samples["trained"] = evaluate(
                engine, task, prompts, 0, target.max_new_tokens, **bounds
            )
    finally:
        engine.shutdown()
    return results, samples, version, n, cached


def run_eval(
    target: Target,
    n: int = DEFAULT_N,
    seed: int = 0,
    threads: int = 1,
    console: Console | None = None,
    fresh_base: bool = False,
) -> dict:
    """Evaluate the target, print the table, write eval.json and eval_samples.jsonl; return the
    report. The base model's result is reused from an earlier evaluation of the same model and
    prompts unless `fresh_base`."""
    from transformers import AutoTokenizer

    if n < 1:
        raise RecipeError(f"--n: must be >= 1, got {n}")
    console = console or Console()
    tokenizer = AutoTokenizer.from_pretrained(target.model)
    task = make_task(target.task, tokenizer)
    try:
        results, samples, version, n, base_from = _evaluate_target(
            target, task, n, seed, threads, console, fresh_base
        )
    finally:
        close_task(task)
    report = {
        "target": str(target.path),
        "kind": target.kind,
        "model": str(target.model),
        "adapter": str(target.adapter) if target.adapter else None,
        "adapter_version": version,
        # the base's stored result when it was reused, not evaluated again (measure/eval_cache.py)
        "base_from": str(base_from) if base_from else None,
        "task": target.task.model_dump(mode="json"),
        "split": "eval",
        "n": n,
        "seed": seed,
        "decoding": "greedy",
        "max_new_tokens": target.max_new_tokens,
        "results": {k: asdict(v) for k, v in results.items()},
    }
    if "base" in results and "trained" in results:
        report["delta"] = {
            k: round(getattr(results["trained"], k) - getattr(results["base"], k), 6)
            for k in ("accuracy", "format_rate", "reward_mean", "avg_turns", "avg_tool_calls")
        }
    target.out.mkdir(parents=True, exist_ok=True)
    (target.out / REPORT).write_text(json.dumps(report, indent=2) + "\n")
    with (target.out / SAMPLES).open("w") as f:
        for which, records in samples.items():
            for r in records:
                f.write(json.dumps({"model": which, **r}) + "\n")
    console.print(report_table(report))
    return report


def report_table(report: dict) -> Table:
    results = report["results"]
    cols = list(results)
    table = Table(
        title=f"{report['task']['name']}: {report['n']} held-out prompts, greedy",
        caption=report["target"],
    )
    table.add_column("metric")
    for c in cols:
        table.add_column(c, justify="right")
    if "delta" in report:
        table.add_column("Δ", justify="right")

    def row(label, key, pct):
        vals = [results[c][key] for c in cols]
        cells = [f"{v:.1%}" if pct else f"{v:.2f}" for v in vals]
        if "delta" in report:
            d = report["delta"][key]
            cells.append(f"{d:+.1%}" if pct else f"{d:+.2f}")
        table.add_row(label, *cells)

    row("accuracy", "accuracy", True)
    row("format rate", "format_rate", True)
    row("reward", "reward_mean", False)
    row("avg turns", "avg_turns", False)
    row("avg tool calls", "avg_tool_calls", False)
    modes = list(dict.fromkeys(m for c in cols for m in results[c]["failure_modes"]))
    for m in modes:
        counts = [results[c]["failure_modes"].get(m, 0) for c in cols]
        cells = [str(k) for k in counts]
        if "delta" in report:
            cells.append(f"{counts[-1] - counts[0]:+d}")
        table.add_row(f"  {m}", *cells)
    return table
