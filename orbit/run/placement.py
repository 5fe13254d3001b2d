"""Where things run: the engine backend `auto` picks, the device checks made at recipe load, and the
memory plan of a trainer and an engine sharing one GPU (device names as each backend takes them:
orbit/engine/devices.py).

The arithmetic functions take their numbers as arguments (GPU count, bytes free) so that they are
tested on a machine without a GPU; `check_devices` and `plan_colocated` ask torch for the numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from orbit.engine.devices import gpu_index

if TYPE_CHECKING:
    from orbit.config import EngineConfig, Recipe

GiB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
HEADROOM = 0.05  # of the card, for the CUDA context, allocator fragmentation and NCCL buffers
# SGLang's static share of a GPU of its own (its default is about this on a large card).
MAX_ENGINE_SHARE = 0.85


def choose_backend(
    devices: list[str], sglang_installed: bool
) -> tuple[Literal["embedded", "sglang"], str]:
    """`engine.backend: auto`: (backend, why, in words). SGLang where it can serve: installed and
    every engine on a GPU; the embedded engine otherwise."""
    on_gpu = all(gpu_index(d) is not None for d in devices)
    where = ", ".join(dict.fromkeys(devices))
    if on_gpu and sglang_installed:
        return "sglang", f"sglang is installed and the engine runs on {where}"
    if on_gpu:
        return "embedded", (
            f"sglang is not installed (pip install 'orbit-rl[sglang]' for SGLang on {where})"
        )
    return "embedded", f"the engine runs on {where}; SGLang is chosen for GPUs"


def device_problems(
    trainers: list[str], engines: list[str], tp: int, backend: str, gpu_count: int
) -> list[str]:
    """Every impossible placement, each naming the field: a GPU that does not exist, tensor
    parallelism outside SGLang, a tensor-parallel group that takes a trainer rank's GPU."""
    problems = []
    trainer_field = "trainer.devices" if len(trainers) > 1 else "trainer.device"
    engine_field = "engine.devices" if len(engines) > 1 else "engine.device"
    for field, device in [(trainer_field, d) for d in trainers] + [
        (engine_field, d) for d in engines
    ]:
        index = gpu_index(device)
        if index is not None and index >= gpu_count:
            have = (
                f"GPUs cuda:0..cuda:{gpu_count - 1}"
                if gpu_count
                else "no CUDA GPU (torch.cuda.is_available() is False)"
            )
            problems.append(f"{field}: {device} does not exist; this machine has {have}")
    if tp > 1 and backend == "embedded":
        problems.append(
            f"engine.tp: {tp} needs an SGLang backend (the embedded engine runs on one device)"
        )
    if tp > 1:
        for i, device in enumerate(engines):
            first = gpu_index(device)
            if first is None:
                problems.append(f"engine.tp: {tp} needs GPUs; engine {i} is on {device}")
                continue
            if first + tp > gpu_count:
                problems.append(
                    f"engine.tp: engine {i} needs cuda:{first}..cuda:{first + tp - 1}; this "
                    f"machine has {gpu_count} GPU(s)"
                )
            for trainer in trainers:
                t = gpu_index(trainer)
                if t is not None and first <= t < first + tp:
                    problems.append(
                        f"{trainer_field}: {trainer} is one of engine {i}'s tensor-parallel GPUs "
                        f"(cuda:{first}..cuda:{first + tp - 1}, taken whole by the group); put the "
                        "trainer on another GPU or use engine.tp: 1"
                    )
    return problems


def check_devices(recipe) -> None:
    """At recipe load: the devices a recipe names exist and can be combined (RecipeError otherwise).
    Attached servers (engine.servers) run where they run and are not checked here."""
    from orbit.config import RecipeError

    cfg = recipe.engine
    engines = [] if cfg.servers else cfg.engine_devices()
    trainers = recipe.trainer.rank_devices()
    if all(gpu_index(d) is None for d in [*trainers, *engines]) and cfg.tp == 1:
        return  # CPU only: nothing to ask torch
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    problems = device_problems(trainers, engines, cfg.tp, cfg.backend, count)
    if problems:
        raise RecipeError("\n".join(problems))


# ---- a trainer and an engine on one GPU ----------------------------------------------------------


@dataclass
class ModelSize:
    params: int
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int

    @classmethod
    def of(cls, model: Path) -> ModelSize:
        from safetensors import safe_open

        from orbit.engine.spec import checkpoint_files, read_spec

        spec, _ = read_spec(model)
        params = 0
        for path in checkpoint_files(model):
            with safe_open(str(path), framework="pt") as f:
                params += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118
        return cls(
            params,
            spec.num_layers,
            spec.num_kv_heads,
            spec.head_dim,
            spec.hidden_size,
            spec.vocab_size,
        )

    def kv_bytes_per_token(self, dtype: str) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[dtype]


@dataclass
class ColocatedPlan:
    """Bytes of one GPU shared by the trainer and the engine, and the engine's resulting
    settings."""

    total: int
    free: int
    engine_weights: int
    trainer_weights: int
    trainer_step: int  # activations and logits of one micro-batch, forward and backward
    kv: int  # the engine's KV cache
    mem_fraction: float  # SGLang's --mem-fraction-static: engine weights + KV, of the whole card
    max_context: int  # embedded engine: tokens per running request its KV pool holds

    def describe(self) -> str:
        def g(x: int) -> str:
            return f"{x / GiB:.2f} GiB"

        return (
            f"model {g(self.engine_weights)} in the engine + {g(self.trainer_weights)} in the "
            f"trainer, trainer step {g(self.trainer_step)}, engine KV {g(self.kv)}; the GPU has "
            f"{g(self.total)}, {g(self.free)} free"
        )


def trainer_step_bytes(size: ModelSize, tokens: int) -> int:
    """A generous estimate of one micro-batch's peak (`tokens`: its padded tokens): ~16 hidden-sized
    fp32 activations per layer and token, plus one chunk of fp32 logits with its log-softmax and
    gradient (3 × CHUNK_ROWS × vocab × 4 B: the trainer projects to the vocabulary a chunk at a
    time)."""
    from orbit.train.batch import CHUNK_ROWS

    logits = 3 * CHUNK_ROWS * size.vocab * 4
    activations = 16 * tokens * size.hidden * size.layers * 4
    return logits + activations


def plan_colocated(
    size: ModelSize,
    total: int,
    free: int,
    engine_dtype: str,
    trainer_dtype: str,
    tokens: int,
    seq: int,
    max_running: int,
    mem_fraction: float | None = None,
    shards: int = 1,
) -> ColocatedPlan:
    """Split one GPU: the trainer keeps room for its weights and step; the engine gets the rest (at
    most MAX_ENGINE_SHARE of the card) for its weights and KV cache. Raises ValueError, with the
    numbers, when the engine's KV cannot hold even `max_running` requests of `seq` tokens. `shards`:
    the trainer rank's base is 1/shards of the model (trainer.shard: fsdp), plus two layers gathered
    at once and the whole output projection (ranks.py)."""
    engine_w = size.params * DTYPE_BYTES[engine_dtype]
    trainer_w = size.params * DTYPE_BYTES[trainer_dtype]
    if shards > 1:
        gathered = 2 * size.params // size.layers + size.vocab * size.hidden
        trainer_w = (size.params // shards + gathered) * DTYPE_BYTES[trainer_dtype]
    step = trainer_step_bytes(size, tokens)
    trainer_room = trainer_w + step + int(HEADROOM * total)
    if mem_fraction is None:
        mem_fraction = min(MAX_ENGINE_SHARE, (free - trainer_room) / total)
    kv = int(mem_fraction * total) - engine_w
    per_token = size.kv_bytes_per_token(engine_dtype)
    per_request = per_token * seq
    plan = ColocatedPlan(
        total,
        free,
        engine_w,
        trainer_w,
        step,
        max(kv, 0),
        round(max(mem_fraction, 0.0), 3),
        max(kv, 0) // max(per_token * max_running, 1),
    )
    if kv < per_request * max_running:
        raise ValueError(
            f"trainer and engine cannot share this GPU: {plan.describe()}; the engine's KV needs "
            f"{per_request * max_running / GiB:.2f} GiB for {max_running} requests of {seq} tokens "
            "(engine.max_running, rollout.max_new_tokens; or trainer.micro_batch_tokens, or a GPU "
            "each)"
        )
    if int(mem_fraction * total) + trainer_room > free:
        raise ValueError(
            f"engine.mem_fraction {mem_fraction:g} leaves the trainer too little: {plan.describe()}"
        )
    return plan


PROMPT_ALLOWANCE = 512  # tokens assumed for a prompt when sizing a step or a request's KV


def colocate(recipe: Recipe, shards: int = 1) -> tuple[EngineConfig, str | None]:
    """The engine settings for a trainer (rank) that shares its GPU with an engine: SGLang's
    mem_fraction and the embedded engine's context (its KV budget), from the model's size and the
    GPU's free memory. Returns (the engine config to start, a line saying what was planned);
    RecipeError if it cannot fit. `shards`: the ranks the base is sharded over (trainer.shard:
    fsdp)."""
    from orbit.config import RecipeError

    cfg, r = recipe.engine, recipe.rollout
    engine_gpus = {gpu_index(d) for d in cfg.engine_devices()}
    shared = [
        d
        for d in recipe.trainer.rank_devices()
        if gpu_index(d) is not None and gpu_index(d) in engine_gpus
    ]
    if cfg.servers or not shared:
        return cfg, None
    t = gpu_index(shared[0])
    field = "trainer.devices" if recipe.trainer.devices else "trainer.device"
    import torch

    free, total = torch.cuda.mem_get_info(t)
    seq = r.max_new_tokens + PROMPT_ALLOWANCE
    tokens = recipe.trainer.micro_batch_tokens or r.group_size * r.prompts_per_step * seq
    try:
        plan = plan_colocated(
            ModelSize.of(recipe.model),
            total,
            free,
            cfg.dtype,
            recipe.trainer.dtype,
            tokens,
            seq,
            cfg.max_running,
            cfg.mem_fraction,
            shards,
        )
    except ValueError as err:
        raise RecipeError(f"{field}: {shared[0]} is also an engine's device: {err}") from None
    update = {"mem_fraction": plan.mem_fraction}
    if cfg.backend == "embedded":
        update["max_context"] = min(cfg.max_context or 4096, plan.max_context)
    note = f"trainer and engine share cuda:{t}: {plan.describe()}; engine " + ", ".join(
        f"{k} {v}" for k, v in update.items()
    )
    return cfg.model_copy(update=update), note
