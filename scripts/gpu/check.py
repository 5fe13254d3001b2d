"""The GPU check: SGLang on CUDA end to end, run in one device command (scripts/gpu/run.sh), and
rehearsed on a CPU first (`make gpu-check` without a GPU: the same steps on the CPU engine and the
tiny model), so that no GPU minute goes to a typo.

    python scripts/gpu/check.py [--device cuda|cpu] [--model 0.5b|tiny] [--out DIR] [--work DIR]

Each step is timed and logged; a step that fails is written down with its error and the next runs.
  env     the machine: GPU, torch, triton, sglang, transformers and peft versions
  model   a random model of Qwen2.5-0.5B's layout (24 layers, hidden 896, 14 heads, 2 KV heads,
          MLP 4864) with the tiny tokenizer, in bf16 on CUDA ('tiny': `orbit model tiny`'s)
  engine  SGLang in-process (on CUDA: Triton attention and LoRA backends, torch's fused ops): a
          LoRA adapter in a slot; greedy and sampled generation; their logprobs against Orbit's
          trainer on the same tokens; a second adapter pushed into the inactive slot and the flip
          (pause, flush where SGLang allows it, activate, continue) timed, under running requests
  modes   `orbit bench` of the five modes for a few steps, trainer and engine on the one device
          (sync modes offload and onload the engine): each mode's step, rollout tokens/s and
          update_weights, and the seed's ratios (step db/sync 0.29, tokens/s db/aa 1.50)
  serve   `orbit serve` on that engine, and the tinker SDK (scripts/gpu/sdk_step.py):
          forward_backward, optim_step, a snapshot sampler and an inflight one
  load    (only when named) bench/serve_load.py: 1, 8 and 32 training clients through the SDK,
          packed against turn by turn, trainer and embedded engine on the device
  sweep   (only when named) bench/sweep.py: a sweep of 4 learning rates, packed and turn by turn,
          against the 4 runs one after another, on the device
Writes OUT/gpu-check.json (every figure, every error), the bench's summary and panels there, and
prints a table; the model and the runs go to WORK. Exit code 0 when every step passed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # orbit from the working tree (the device command carries it)

# What SGLang runs with on the lent GPU (the sglang-kernel and FlashInfer wheels are not there):
# Triton attention and LoRA kernels, torch's sampling, no grammar; CUDA graphs off at first.
CUDA_SGLANG_ARGS = {
    "attention_backend": "triton",
    "sampling_backend": "pytorch",
    "lora_backend": "triton",
    "grammar_backend": "none",
    "disable_cuda_graph": True,
}
# SGLang's share of the GPU's memory (weights and KV cache): the trainer, on the same GPU, takes
# the rest (SGLang's own default leaves a trainer almost nothing)
CUDA_MEM_FRACTION = 0.4
QWEN25_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
)
SEED_RATIOS = {"step db/sync": 0.29, "tokens/s db/async-adapter": 1.50, "update_weights": 0.118}


@dataclass
class Step:
    name: str
    ok: bool = False
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)
    error: str | None = None


@dataclass
class Check:
    device: str
    size: str
    out: Path
    work: Path
    steps: int
    graphs: bool
    log: list[Step] = field(default_factory=list)

    def run(self, name: str, fn: Callable[[dict], None]) -> Step:
        """One step: its figures, its time, its error (the traceback's end) if it failed."""
        step = Step(name)
        print(f"== {name}", flush=True)
        t0 = time.monotonic()
        try:
            fn(step.figures)
            step.ok = True
        except BaseException as err:  # noqa: BLE001 - a failure is a finding, written down
            step.error = f"{type(err).__name__}: {err}\n" + "".join(
                traceback.format_exc().splitlines(keepends=True)[-12:]
            )
            print(step.error, flush=True)
            if isinstance(err, KeyboardInterrupt):
                raise
        step.seconds = round(time.monotonic() - t0, 1)
        print(f"== {name}: {'ok' if step.ok else 'FAILED'} in {step.seconds} s", flush=True)
        self.log.append(step)
        self.write()
        return step

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        report = {"device": self.device, "size": self.size, "steps": [asdict(s) for s in self.log]}
        (self.out / "gpu-check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def dtype(self) -> str:
        return "bfloat16" if self.cuda else "float32"

    @property
    def model(self) -> Path:
        return self.work / f"model-{self.size}"

    def sglang_args(self) -> dict:
        return {**CUDA_SGLANG_ARGS, "disable_cuda_graph": not self.graphs} if self.cuda else {}


# ---- the steps ----------------------------------------------------------------------------------


def env(check: Check, figures: dict) -> None:
    if not check.cuda:  # SGLang on a CPU: Orbit's shims before sglang is imported
        from orbit.engine.sglang_cpu import prepare_cpu_environment

        prepare_cpu_environment()
    import peft
    import torch
    import transformers

    figures.update(
        python=platform.python_version(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        transformers=transformers.__version__,
        peft=peft.__version__,
        machine=platform.machine(),
        cpus=os.cpu_count(),
    )
    for name in ("triton", "sglang"):
        try:
            figures[name] = __import__(name).__version__
        except ImportError as err:
            figures[name] = f"missing: {err}"
    if check.cuda:
        props = torch.cuda.get_device_properties(0)
        figures.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            capability=f"{props.major}.{props.minor}",
        )
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        figures["nvidia_smi"] = smi.stdout.strip()


def build_model(check: Check, figures: dict) -> None:
    """Qwen2.5-0.5B's layout with the tiny tokenizer (the tests' and the bench's vocabulary), random
    weights scaled as `orbit model tiny` scales them, saved in the check's dtype."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from orbit.models.tiny import build_tiny_model, build_tokenizer

    if check.size == "tiny":
        build_tiny_model(check.model, arch="qwen2", seed=0)
    else:
        tok = build_tokenizer(0)
        config = Qwen2Config(
            vocab_size=len(tok),
            **QWEN25_05B,
            max_position_embeddings=2048,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            pad_token_id=tok.pad_token_id,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
        )
        torch.manual_seed(0)
        with torch.device(check.device if check.cuda else "cpu"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.08 * (64 / config.hidden_size) ** 0.5)
        model.to(getattr(torch, check.dtype)).save_pretrained(check.model)
        tok.save_pretrained(check.model)
    n = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(check.model).parameters())
    figures.update(path=str(check.model), parameters=n)


def engine(check: Check, figures: dict) -> None:
    from orbit.config import AdapterConfig, TrainerConfig
    from orbit.engine.base import ACTIVE, SamplingParams
    from orbit.engine.sglang import start_sglang_engine
    from orbit.rollout.sample import Sample
    from orbit.train.trainer import Trainer

    t0 = time.monotonic()
    eng = start_sglang_engine(
        check.model,
        device=check.device,
        dtype=check.dtype,
        max_running=16,
        slots=2,
        max_lora_rank=8,
        extra=tuple(check.sglang_args().items()),
        mem_fraction=CUDA_MEM_FRACTION if check.cuda else None,
    )
    figures["start_s"] = round(time.monotonic() - t0, 2)
    try:
        trainer = Trainer(
            check.model,
            AdapterConfig(r=8, alpha=16),
            TrainerConfig(devices=[check.device], dtype=check.dtype),
            temperature=1.0,
            seed=1,
        )
        config = trainer.adapter_config()
        t0 = time.monotonic()
        eng.load_adapter(0, _random_adapter(trainer, seed=1), config, 1)
        eng.activate(0)
        figures["load_adapter_s"] = round(time.monotonic() - t0, 3)
        prompt = list(range(10, 42))
        greedy = eng.generate(prompt, SamplingParams(max_new_tokens=32, temperature=0.0))
        sampled = eng.generate(prompt, SamplingParams(max_new_tokens=32, temperature=1.0))
        # the trainer's logprobs of the engine's tokens at the adapter the engine serves (greedy's
        # are log_softmax at temperature 1, as sampled ones at 1)
        diffs = {}
        for label, future in (("greedy", greedy), ("sampled", sampled)):
            c = future.result(600)
            sample = Sample(prompt, list(c.output_ids), list(c.logprobs), 0.0, 1, 1)
            d = [abs(a - b) for a, b in zip(trainer.logprobs([sample])[0], c.logprobs, strict=True)]
            diffs[label] = {"tokens": len(d), "mean": sum(d) / len(d), "max": max(d)}
        figures["logprob_diff"] = diffs
        # the double buffer: slot 1 written while slot 0 serves running requests, then the flip
        second = _random_adapter(trainer, seed=2)
        long = SamplingParams(max_new_tokens=64, temperature=1.0, ignore_eos=True)
        running = [eng.generate(prompt, long) for _ in range(8)]
        t0 = time.monotonic()
        eng.load_adapter(1, second, config, 2)
        t_loaded = time.monotonic()
        eng.pause_generation("in_place")
        t_paused = time.monotonic()
        flush: bool | str = True
        try:
            eng.flush_cache()
        except Exception as err:  # noqa: BLE001 - SGLang refuses a flush with requests running
            flush = f"refused: {err}"
        eng.activate(1)
        eng.continue_generation()
        t_flipped = time.monotonic()
        after = eng.generate(prompt, SamplingParams(max_new_tokens=8), slot=ACTIVE).result(600)
        done = [f.result(600) for f in running]
        figures.update(
            push_inactive_s=round(t_loaded - t0, 3),
            pause_s=round(t_paused - t_loaded, 4),
            flip_s=round(t_flipped - t_loaded, 4),
            flush=flush,
            running_finished=len(done),
            running_versions=sorted({(c.version_start, c.version_end) for c in done}),
            after_flip_version=after.version_start,
        )
        assert after.version_start == 2, f"a request after the flip ran on version {after}"
        figures["stats"] = {
            k: v for k, v in asdict(eng.stats()).items() if not isinstance(v, dict | list)
        }
        trainer.close()
    finally:
        eng.shutdown()


def _random_adapter(trainer, seed: int) -> dict:
    """The trainer's LoRA A and B set to random non-zero values (peft starts at the identity), and
    a copy of them as the engine takes them."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_" in name:
                p.copy_((torch.randn(p.shape, generator=gen) * 0.05).to(p.dtype))
    return {k: v.detach().clone() for k, v in trainer.adapter_tensors().items()}


def modes(check: Check, figures: dict) -> None:
    from rich.console import Console

    from orbit.config import parse_recipe
    from orbit.measure.bench import run_bench
    from orbit.run.preflight import preflight

    recipe = {
        "model": str(check.model),
        "adapter": {"type": "lora", "r": 8, "alpha": 16},
        "engine": {
            "backend": "sglang",
            "devices": [check.device],
            "dtype": check.dtype,
            "max_inflight": 32,
            "max_running": 32,
            "slots": 4,
            "flip": "barrier",
            **(
                {"sglang_args": recipe_sglang_args(check), "mem_fraction": CUDA_MEM_FRACTION}
                if check.cuda
                else {}
            ),
        },
        "rollout": {"group_size": 8, "prompts_per_step": 4, "max_new_tokens": 128},
        "trainer": {"devices": [check.device], "dtype": check.dtype, "lr": 0.001, "steps": 10},
        "task": {"name": "pattern", "target": "yes"},
        "max_staleness": 2,
        "out": str(check.work / "bench-work"),
    }
    checked = preflight(parse_recipe(recipe))
    bench = check.work / "bench"
    result = run_bench(checked, bench, steps=check.steps, warmup=1, console=Console(width=160))
    shutil.copy(bench / "summary.json", check.out / "bench-summary.json")
    for png in (bench / "sglang").glob("panels*.png"):
        shutil.copy(png, check.out / png.name)
    section = result.summary["engines"]["sglang"]
    figures["modes"] = {
        mode: {
            key: (s.get(key) or {}).get("median")
            for key in ("step_s", "rollout_tok_per_dev_s", "update_weights_s", "trainer_idle_s")
        }
        for mode, s in section["modes"].items()
    }
    figures["targets"] = section.get("targets")
    figures["seed"] = SEED_RATIOS


def recipe_sglang_args(check: Check) -> dict:
    """The arguments as a recipe may give them: without lora_backend, which Orbit sets itself on a
    CPU and leaves to SGLang's default (csgmv, a Triton kernel) on a GPU."""
    return {k: v for k, v in check.sglang_args().items() if k != "lora_backend"}


def serve(check: Check, figures: dict) -> None:
    from orbit.config import parse_recipe
    from orbit.host.net import free_port
    from orbit.serve.command import Options, serving

    engine = {
        "backend": "sglang",
        "devices": [check.device],
        "dtype": check.dtype,
        "slots": 4,
        "max_running": 16,
    }
    if check.cuda:
        engine.update(sglang_args=recipe_sglang_args(check), mem_fraction=CUDA_MEM_FRACTION)
    recipe = parse_recipe(
        {
            "model": str(check.model),
            "engine": engine,
            "trainer": {"devices": [check.device], "dtype": check.dtype},
        }
    )
    options = Options(directory=check.work / "serve", port=free_port())
    with serving(recipe, options) as (url, service):
        figures["trainer_device"] = str(service.bases[0].shared.device)
        res = subprocess.run(
            [sdk_python(), str(Path(__file__).parent / "sdk_step.py"), url, str(check.model)],
            capture_output=True,
            text=True,
            timeout=900,
            env={**os.environ, "TINKER_TELEMETRY": "0", "TINKER_API_KEY": "tml-local"},
        )
    lines = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
    if res.returncode != 0 or not lines:
        raise RuntimeError(f"the SDK step failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    figures.update(json.loads(lines[-1].removeprefix("RESULT ")))


def load(check: Check, figures: dict) -> None:
    """bench/serve_load.py on the check's model: training clients through the SDK, packed against
    turn by turn, trainer and embedded engine on the check's device (issue 56's GPU table)."""
    counts = "1,8,32" if check.cuda else "1,2"
    out = check.out / "serve-load.json"
    cmd = [sys.executable, str(ROOT / "bench" / "serve_load.py"), "--model", str(check.model)]
    cmd += ["--device", check.device, "--clients", counts, "--steps", "3", "--json", str(out)]
    try:
        _logged(cmd, check.out / "load.log")
    finally:  # what it measured before it failed or the device command's limit stopped it
        if out.exists():
            for n, by_mode in json.loads(out.read_text()).items():
                figures[n] = {
                    mode: {k: r[k] for k in ("tokens_s", "requests_s", "latency", "peak_rss_mib")}
                    for mode, r in by_mode.items()
                }


def sweep(check: Check, figures: dict) -> None:
    """bench/sweep.py on the check's model: a sweep of 4 learning rates, packed and turn by turn,
    against the 4 runs one after another (one seed), trainer and engine on the check's device."""
    out = check.work / "sweep"
    cmd = [sys.executable, str(ROOT / "bench" / "sweep.py"), "--model", str(check.model)]
    cmd += ["--device", check.device, "--one-seed", "--out", str(out)]
    cmd += ["--steps", "10" if check.cuda else "3"]
    try:
        _logged(cmd, check.out / "sweep.log")
    finally:
        if (out / "summary.json").exists():
            summary = json.loads((out / "summary.json").read_text())
            shutil.copy(out / "summary.json", check.out / "sweep-summary.json")
            keys = ("sweep_s", "turns_s", "alone_s", "ratio")  # the whole run's; else the sweeps'
            figures.update({k: summary[k] for k in keys if k in summary} or {"sweeps": summary})


def _logged(cmd: list[str], log: Path) -> None:
    """Run a bench script with its output in `log` (in OUT: what it printed comes back even when
    the device command's limit stops it); RuntimeError with the log's end if it failed."""
    with log.open("w") as f:
        res = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True)
    if res.returncode != 0:
        raise RuntimeError(
            f"{Path(cmd[1]).name} exited {res.returncode}:\n{log.read_text()[-3000:]}"
        )


def sdk_python() -> str:
    """The interpreter with the tinker SDK: this one on the lent GPU (the carry), .venv-tinker
    here (make tinker)."""
    here = ROOT / ".venv-tinker" / "bin" / "python"
    return str(here) if here.exists() else sys.executable


# serve before modes: the five modes take most of the time, and a device command has a limit
STEPS = {"env": env, "model": build_model, "engine": engine, "serve": serve, "modes": modes}
# not by default (--only env,model,load,sweep): a device command of their own
STEPS.update(load=load, sweep=sweep)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda where there is one)")
    p.add_argument("--model", choices=("0.5b", "tiny"), default=None, help="default: 0.5b on cuda")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu-check", help="the report")
    p.add_argument("--work", type=Path, default=None, help="model and runs (default OUT/work)")
    p.add_argument("--steps", type=int, default=4, help="measured steps per mode (after 1 warm-up)")
    p.add_argument("--graphs", action="store_true", help="CUDA graphs on (SGLang's default)")
    default = "env,model,engine,serve,modes"
    p.add_argument("--only", default=default, help="steps to run, of " + ",".join(STEPS))
    args = p.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda:0" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda":
        args.device = "cuda:0"
    size = args.model or ("0.5b" if args.device.startswith("cuda") else "tiny")
    work = args.work or args.out / "work"
    check = Check(args.device, size, args.out, work, args.steps, args.graphs)
    for name in args.only.split(","):
        check.run(name, lambda figures, fn=STEPS[name]: fn(check, figures))
    print(summary(check))
    return 0 if all(s.ok for s in check.log) else 1


def summary(check: Check) -> str:
    rows = [f"GPU check on {check.device}, model {check.size}: {check.out / 'gpu-check.json'}"]
    for s in check.log:
        rows.append(f"  {s.name:7s} {'ok' if s.ok else 'FAILED':7s} {s.seconds:7.1f} s")
        if s.error:
            rows.append("          " + s.error.splitlines()[0][:200])
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
