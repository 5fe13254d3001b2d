"""Where a laptop trainer step's time goes: phase by phase, its FLOPs and its seconds, against the
step's floor (its useful FLOPs at this machine's measured matmul peak).

    .venv/bin/python bench/investigations/trainer_profile.py [--recipe recipes/smollm2-math.yaml]
        [--steps 6] [--threads 1,2] [--record] [--compile]

The batches are real: the recipe's own first steps, recorded once (`--record`, or when none are
saved) into .cache/bench/ with the samples exactly as its trainer received them. Each batch is then
trained again, one optimizer step each, by the recipe's Trainer, split into its phases so each can
be timed apart (the same computation as Trainer.step, in the same order):

- decoder forward: each prompt once, each sample's outputs on its keys and values (batch.py);
- vocabulary forward: the output projection, log-softmax and truncation, chunk by chunk;
- loss; vocabulary backward (with the recompute of each chunk that activation checkpointing makes);
- decoder backward (the input gradients through the frozen base, and LoRA's own gradients);
- agreement re-score: the no-grad forward over a few samples that a step with no fresh sample runs
  for `logprob_diff` (every double-buffer step: Trainer._rescore, here under the current weights);
- optimizer: gradient clipping, AdamW, the schedule.

FLOPs are torch.profiler's (matmuls) per phase. LoRA's own matmuls are those with the adapter's rank
as a dimension, counted across phases. Padding: the decoder tokens that are padding, as a share of
the decoder tokens run. Useful FLOPs, as issue 39 counts them: 4 x parameters x trained tokens
(forward and backward through the frozen base). The matmul peak is torch.mm on the model's shapes
(bench/investigations/cores.py). Run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler's start/stop lines, each phase
import torch  # noqa: E402
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[2]
from trainer_gpu import compile_layers  # noqa: E402  (bench/investigations/: its own folder)

from orbit.config import load_recipe  # noqa: E402
from orbit.measure.flops import matmul_peak  # noqa: E402
from orbit.rl import policy_loss  # noqa: E402
from orbit.rollout.sample import Sample  # noqa: E402
from orbit.train.batch import (  # noqa: E402
    length_buckets,
    output_hidden,
    output_widths,
    token_logprobs,
)
from orbit.train.trainer import Trainer, recipe_trainer, rescore_choice  # noqa: E402

PHASES = (
    "decoder forward",
    "vocabulary forward",
    "loss",
    "vocabulary backward + recompute",
    "decoder backward",
    "agreement re-score",
    "optimizer",
)


def record(recipe_path: Path, steps: int, where: Path) -> list[list[Sample]]:
    """Run the recipe's first `steps` steps (engines and all); keep each batch its trainer got."""
    from orbit.run import train
    from orbit.run.preflight import preflight

    batches: list[list[Sample]] = []
    real_step = Trainer.step

    def keeping(self: Trainer, samples: list[Sample]):
        batches.append(list(samples))
        return real_step(self, samples)

    Trainer.step = keeping  # type: ignore[method-assign]
    try:
        with tempfile.TemporaryDirectory() as out:
            recipe = load_recipe(recipe_path, {"trainer.steps": steps, "out": f"{out}/run"})
            train(preflight(recipe), live=False)
    finally:
        Trainer.step = real_step  # type: ignore[method-assign]
    where.parent.mkdir(parents=True, exist_ok=True)
    where.write_bytes(pickle.dumps(batches))
    return batches


class Phases:
    """Seconds and profiler FLOPs per phase, summed over the steps measured."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.flops: dict[str, float] = defaultdict(float)
        self.lora_flops = 0.0
        self.lora_seconds = 0.0

    @contextmanager
    def phase(self, name: str, rank: int, flops: bool):
        """Time the block, or (`flops`) count its matmul FLOPs under the profiler (whose own cost
        would distort the times)."""
        if not flops:
            t = time.perf_counter()
            yield
            self.seconds[name] += time.perf_counter() - t
            return
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], with_flops=True, record_shapes=True
        ) as prof:
            yield
        for e in prof.events():
            self.flops[name] += e.flops or 0
            shapes = [s for s in (e.input_shapes or []) if s]
            if e.name in ("aten::mm", "aten::addmm") and any(rank in s for s in shapes):
                self.lora_flops += e.flops or 0
                self.lora_seconds += e.self_cpu_time_total / 1e6


def profiled_step(
    trainer: Trainer, samples: list[Sample], out: Phases | None, flops: bool = False, step: int = 0
) -> float:
    """One optimizer step of `trainer` on `samples`, phase by phase (timed into `out`, or their
    FLOPs counted); its seconds. `step`: which groups the re-score takes (they turn step by
    step)."""
    rank = trainer.adapter.r

    @contextmanager
    def phase(name: str):
        if out is None:
            yield
        else:
            with out.phase(name, rank, flops):
                yield

    t0 = time.perf_counter()
    trainer.model.train()
    trainer.optimizer.zero_grad(set_to_none=True)
    norm = trainer._norm(samples)
    for chunk, _ in trainer._micro_batches(samples):
        batch = trainer._collate(chunk)
        with phase("decoder forward"):
            hidden = output_hidden(trainer._decoder, batch, trainer.buckets, trainer.bucket_cost)
        cut = hidden.detach().requires_grad_()
        with phase("vocabulary forward"):
            logp, entropy = token_logprobs(
                cut,
                trainer._head,
                batch.output_ids,
                batch.outputs,
                trainer.temperature,
                trainer.top_p,
                trainer.top_k,
            )
        with phase("loss"):
            loss, _ = policy_loss(
                logp,
                batch.behaviour,
                batch.advantages,
                batch.loss_mask,
                trainer.algo,
                norm,
                entropy=entropy,
            )
        with phase("vocabulary backward + recompute"):
            loss.backward()
        with phase("decoder backward"):
            hidden.backward(cut.grad)
    with phase("agreement re-score"):
        rescore(trainer, samples, step)
    with phase("optimizer"):
        torch.nn.utils.clip_grad_norm_(trainer.params, trainer.cfg.max_grad_norm)
        trainer.optimizer.step()
        trainer.scheduler.step()
    return time.perf_counter() - t0


def decoder_tokens(trainer: Trainer, samples: list[Sample]) -> tuple[int, int]:
    """(decoder tokens run, of them real) over the step's micro-batches: the prompt pass padded to
    its widest prompt, each pass of outputs (batch.length_buckets) to its widest output."""
    run = real = 0
    for chunk, _ in trainer._micro_batches(samples):
        b = trainer._collate(chunk)
        run += b.prompt_mask.numel()
        buckets = length_buckets(output_widths(b), trainer.buckets, trainer.bucket_cost)
        run += sum(len(m) * w for m, w in buckets)
        real += int(b.prompt_mask.sum()) + int(b.outputs[:, 1:].sum())
    return run, real


def measure(
    recipe_path: Path, batches: list[list[Sample]], threads: int, compiled: bool = False
) -> dict:
    recipe = load_recipe(recipe_path, {"trainer.threads": threads})
    trainer = recipe_trainer(recipe)
    if compiled:
        compile_layers(trainer)
    params = trainer.matmul_params  # the decoder layers' weights and the output head's
    t = time.perf_counter()
    profiled_step(trainer, batches[0], None)  # warm-up: allocator, first-call costs, the compile
    warm_s = time.perf_counter() - t
    phases = Phases()
    plain: list[float] = []
    trained = run = real = 0
    for i, samples in enumerate(batches):
        plain.append(profiled_step(trainer, samples, phases, step=i))
        profiled_step(trainer, samples, phases, flops=True, step=i)
        trained += sum(sum(1 for m in s.loss_mask if m) for s in samples if not s.left_out)
        r, k = decoder_tokens(trainer, samples)
        run, real = run + r, real + k
    trainer.close()
    n = len(batches)
    return {
        "threads": threads,
        "compiled": compiled,
        "warm_s": warm_s,
        "step_s": statistics.median(plain),
        "seconds": {k: v / n for k, v in phases.seconds.items()},
        "flops": {k: v / n for k, v in phases.flops.items()},
        "lora_seconds": phases.lora_seconds / n,  # under the profiler: an estimate
        "lora_flops": phases.lora_flops / n,
        "useful_flops": 4 * params * trained / n,
        "trained_tokens": trained / n,
        "padding": 1 - real / run,
    }


def rescore(trainer: Trainer, samples: list[Sample], step: int) -> None:
    """The forward of Trainer._rescore on the samples it would take this step (the weights it
    swaps in are the same size, so the current ones cost the same)."""
    chosen = rescore_choice(samples, step)
    trainer.model.eval()
    try:
        with torch.no_grad():
            trainer._logprobs(trainer._collate(chosen))
    finally:
        trainer.model.train()


def show(console: Console, r: dict, peak: float) -> None:
    total_s = sum(r["seconds"].values())
    total_f = sum(r["flops"].values())
    how = f"{r['threads']} thread(s){', compiled' if r['compiled'] else ''}"
    t = Table(title=f"trainer step, {how}: phases summed {total_s:.2f} s")
    for c in ("phase", "seconds", "share of time", "GFLOP", "share of FLOPs", "GFLOP/s"):
        t.add_column(c, justify="left" if c == "phase" else "right")
    for p in PHASES:
        s, f = r["seconds"].get(p, 0.0), r["flops"].get(p, 0.0)
        t.add_row(
            p,
            f"{s:.3f}",
            f"{s / total_s:.0%}",
            f"{f / 1e9:.1f}",
            f"{f / total_f:.0%}",
            f"{f / 1e9 / s:.1f}" if s else "-",
        )
    t.add_row(
        "of which LoRA's matmuls",
        f"{r['lora_seconds']:.3f}",
        f"{r['lora_seconds'] / total_s:.0%}",
        f"{r['lora_flops'] / 1e9:.1f}",
        f"{r['lora_flops'] / total_f:.0%}",
        "",
    )
    console.print(t)
    floor = r["useful_flops"] / (peak * 1e9)
    console.print(
        f"step {r['step_s']:.2f} s (median); {r['trained_tokens']:.0f} trained tokens; "
        f"padding {r['padding']:.0%} of decoder tokens; useful {r['useful_flops'] / 1e9:.1f} GFLOP"
        f" -> {r['useful_flops'] / 1e9 / r['step_s']:.1f} GFLOP/s = "
        f"{r['useful_flops'] / 1e9 / r['step_s'] / peak:.2f} of the {peak:.0f} GFLOP/s peak; "
        f"floor {floor:.2f} s, step/floor {r['step_s'] / floor:.1f}x; "
        f"first step {r['warm_s']:.1f} s"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "smollm2-math.yaml")
    p.add_argument("--steps", type=int, default=6, help="batches recorded (and profiled)")
    p.add_argument("--threads", default="1,2", help="trainer threads to profile with, in turn")
    p.add_argument("--record", action="store_true", help="record the batches again")
    p.add_argument(
        "--compile", action="store_true", help="each also with its MLPs compiled (trainer_gpu.py)"
    )
    args = p.parse_args()
    saved = ROOT / ".cache" / "bench" / f"{args.recipe.stem}-batches.pkl"
    if args.record or not saved.exists():
        batches = record(args.recipe, args.steps, saved)
    else:
        batches = pickle.loads(saved.read_bytes())[: args.steps]
    console = Console(width=120)
    for threads in (int(x) for x in args.threads.split(",")):
        peak = matmul_peak(threads)
        console.print(f"torch.mm peak, float32, {threads} thread(s): {peak:.1f} GFLOP/s")
        for compiled in (False, True) if args.compile else (False,):
            show(console, measure(args.recipe, batches, threads, compiled), peak)


if __name__ == "__main__":
    main()
