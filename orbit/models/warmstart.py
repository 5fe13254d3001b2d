"""Warm start: a short supervised pass that gives the tiny model partial competence on a task.

RL from a random model would spend its whole budget discovering the answer format; an instruct
model starts with some skill. `orbit model tiny OUT --task arith|zorplex` builds the tiny model
(with the task tokenizer) and fine-tunes all of its weights on the task's demonstrations (prompt →
correct episode, tool calls included; prompt and tool results are masked out of the loss), stopping
early on purpose so that RL has room to improve.

Deterministic on one machine: seeded, one torch thread, fixed data order. Not across machines:
torch's kernels round differently on another instruction set or vendor (orbit/host/floats.py), and a
thousand optimizer steps make that another model. Cached: the result is stored under
`<cache>/warm/<task>-<arch>-<size>-s<seed>-<hash>` (cache = $ORBIT_CACHE or `.cache`) and copied
from there, so tests and repeated builds pay for it once; the hash covers the code that shapes the
result and the machine's floats, so a change to either builds afresh.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import orbit.models.tiny
import orbit.tasks.arith
import orbit.tasks.base
import orbit.tasks.common
import orbit.tasks.zorplex
from orbit.host.files import cache_root, write_dir
from orbit.host.floats import float_kernels
from orbit.tasks.base import Prompt, Segment

WARM_TASKS = ("arith", "zorplex")


@dataclass(frozen=True)
class WarmConfig:
    """The supervised pass. The step counts are tuned to stop at partial competence on the tiny
    model (roughly 40-60% greedy accuracy on held-out prompts) in well under a minute on 2 cores."""

    steps: int
    tagged: float = 0.5  # fraction of demonstrations that answer in the task's answer tag
    batch: int = 64
    lr: float = 3e-3
    warmup: int = 50
    max_grad_norm: float = 1.0


WARM_CONFIGS = {
    "arith": WarmConfig(steps=1000, tagged=0.45),
    "zorplex": WarmConfig(steps=150, tagged=0.45),
}


def _code_version() -> str:
    h = hashlib.sha256()
    for module in (
        orbit.models.tiny,
        orbit.tasks.base,
        orbit.tasks.common,
        orbit.tasks.arith,
        orbit.tasks.zorplex,
    ):
        h.update(Path(str(module.__file__)).read_bytes())
    h.update(Path(__file__).read_bytes())
    h.update(torch.__version__.encode())
    h.update(float_kernels().encode())
    return h.hexdigest()[:12]


def cache_dir(
    task: str, arch: str = "llama", seed: int = 0, size: str = "tiny", root: Path | None = None
) -> Path:
    return (root or cache_root()) / "warm" / f"{task}-{arch}-{size}-s{seed}-{_code_version()}"


def warm_model(
    task: str,
    arch: str = "llama",
    seed: int = 0,
    size: str = "tiny",
    root: Path | None = None,
    log=None,
) -> Path:
    """The cached warm-started checkpoint for (task, arch, size, seed, code version); built if
    missing."""
    if task not in WARM_TASKS:
        raise ValueError(f"--task must be one of {WARM_TASKS}, got {task!r}")
    path = cache_dir(task, arch, seed, size, root)
    if (path / "warmstart.json").exists():
        return path
    try:
        write_dir(path, lambda tmp: build_warm_model(tmp, task, arch, seed, size, log=log))
    except OSError:  # the rename: a concurrent build of the same key won the race, harmlessly
        if not (path / "warmstart.json").exists():
            raise
    return path


def warm_start(
    out: str | Path,
    task: str,
    arch: str = "llama",
    seed: int = 0,
    size: str = "tiny",
    root: Path | None = None,
    log=None,
) -> Path:
    """Write the warm-started checkpoint to `out` (from the cache when it is there)."""
    src = warm_model(task, arch, seed, size, root, log=log)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file():
            shutil.copy2(f, out / f.name)
    return out


# ---- the supervised pass ------------------------------------------------------------------------


def demo_sequence(prompt: Prompt, segments: list[Segment]) -> tuple[list[int], list[int]]:
    """Input ids and labels of one demonstration: -100 (no loss) on the prompt and tool results."""
    ids, labels = list(prompt.prompt_ids), [-100] * len(prompt.prompt_ids)
    for seg in segments:
        ids += seg.ids
        labels += list(seg.ids) if seg.trained else [-100] * len(seg.ids)
    return ids, labels


def untagged(segments: list[Segment], tokenizer) -> list[Segment]:
    """The same demonstration with its final answer written plainly (`47` instead of
    `<answer>47</answer>`), then eos: the answer is right, the format is not."""
    last = segments[-1]
    text = tokenizer.decode([t for t in last.ids if t != tokenizer.eos_token_id])
    plain = text.replace("<answer>", "").replace("</answer>", "")
    ids = tokenizer.encode(plain, add_special_tokens=False) + [tokenizer.eos_token_id]
    return segments[:-1] + [Segment(tuple(ids), True)]


def _collate(rows: list[tuple[list[int], list[int]]], pad_id: int):
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (x, y) in enumerate(rows):
        ids[i, : len(x)] = torch.tensor(x)
        labels[i, : len(y)] = torch.tensor(y)
        attn[i, : len(x)] = 1
    return ids, labels, attn


def build_warm_model(
    out: str | Path,
    task: str,
    arch: str = "llama",
    seed: int = 0,
    size: str = "tiny",
    config: WarmConfig | None = None,
    log=None,
) -> Path:
    """Build the tiny model with the task tokenizer, fine-tune it on demonstrations, save to
    `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from orbit.config import TaskConfig
    from orbit.tasks import make_task

    cfg = config or WARM_CONFIGS[task]
    out = Path(out)
    t0 = time.time()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same float reductions on every run: the same bytes, per machine
    try:
        orbit.models.tiny.build_tiny_model(out, arch=arch, seed=seed, size=size, task_tokens=True)
        tokenizer = AutoTokenizer.from_pretrained(out)
        # the warm start's tasks (WARM_TASKS) show a demonstration of each prompt
        the_task: Any = make_task(TaskConfig(name=task), tokenizer)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min(1.0, (s + 1) / cfg.warmup) * max(0.0, 1.0 - s / cfg.steps)
        )
        prompts = the_task.prompts(seed, "train")
        rng = random.Random(f"warm-{task}-{seed}")
        pad = tokenizer.pad_token_id
        losses = []
        for step in range(cfg.steps):
            rows = []
            for _ in range(cfg.batch):
                p = next(prompts)
                segments = the_task.demonstration(p)
                if rng.random() >= cfg.tagged:
                    segments = untagged(segments, tokenizer)
                rows.append(demo_sequence(p, segments))
            ids, labels, attn = _collate(rows, pad)
            loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            optimizer.step()
            schedule.step()
            losses.append(float(loss.detach()))
            if log is not None and (step + 1) % max(1, cfg.steps // 5) == 0:
                log(f"warm start {task}: step {step + 1}/{cfg.steps} loss {losses[-1]:.3f}")
        if not all(math.isfinite(x) for x in losses):
            raise FloatingPointError("warm start diverged (non-finite loss)")
        model.save_pretrained(out, safe_serialization=True)
    finally:
        torch.set_num_threads(threads)
    info = {
        "task": task,
        "arch": arch,
        "size": size,
        "seed": seed,
        "code_version": _code_version(),
        "floats": float_kernels(),
        "config": asdict(cfg),
        "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4),
    }
    (out / "warmstart.json").write_text(json.dumps(info, indent=2) + "\n")
    if log is not None:
        log(
            f"warm start {task}: {cfg.steps} steps in {time.time() - t0:.1f}s, final loss "
            f"{info['final_loss']}"
        )
    return out
