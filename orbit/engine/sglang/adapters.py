"""What an adapter push becomes before it reaches SGLang, and the directory it travels through to
servers on other hosts.

`prepare_adapter` validates a peft state dict against the model (orbit/engine/checks.py, shared
with the embedded engine) and against what the engine was started with (rank, target modules),
then converts it to what SGLang loads correctly (sglang_cpu/adapter_format.py: the missing members
of fused q/k/v or gate/up groups zero-filled, rsLoRA folded into alpha). EngineError means nothing
reached SGLang.

`write_peft_dir` writes an adapter as peft's own format (adapter_model.safetensors and
adapter_config.json, which `PeftModel.from_pretrained` loads too) atomically: into a temporary
directory next to the target, then renamed, so a server never reads half a write.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from orbit.engine.base import EngineError
from orbit.engine.checks import check_adapter, plain_config
from orbit.engine.sglang_cpu.adapter_format import to_sglang_lora
from orbit.engine.spec import ModelSpec
from orbit.host.files import write_dir


def prepare_adapter(
    tensors: dict,
    adapter_config: dict,
    spec: ModelSpec,
    hf_config: dict,
    lora: bool,
    max_rank: int,
    targets: set[str],
    dtype: torch.dtype,
) -> tuple[dict, dict]:
    """Validate and convert a LoRA push; returns fresh contiguous CPU tensors in the engine's
    dtype."""
    if not lora:
        raise EngineError("this SGLang engine was started without LoRA: it has no adapter slots")
    config = plain_config(adapter_config)
    kind, found = check_adapter(tensors, config, spec, engine="the SGLang backend")
    if kind == "oft":
        raise EngineError(
            "SGLang serves LoRA adapters only: an OFT adapter cannot go into a slot on this "
            "backend (supports_oft_slots is False; Orbit pushes OFT as merged weights instead)"
        )
    r = int(config["r"])
    if r > max_rank:
        raise EngineError(f"adapter r={r} exceeds the engine's max_lora_rank={max_rank}")
    modules = {module.rsplit(".", 1)[-1] for _, module in found}
    if modules - targets:
        raise EngineError(
            f"adapter targets {sorted(modules - targets)}, but the engine was started with "
            f"lora_target_modules {sorted(targets)}"
        )
    try:
        tensors, config = to_sglang_lora(
            {k: v.detach() for k, v in tensors.items()}, config, hf_config
        )
    except ValueError as e:
        raise EngineError(str(e)) from None
    # fresh CPU copies: the in-process transport's serialization moves their storage into shared
    # memory
    return {
        k: v.detach().to("cpu", dtype, copy=True).contiguous() for k, v in tensors.items()
    }, config


def write_peft_dir(root: Path, name: str, tensors: dict, config: dict) -> Path:
    """`root/name` holding the adapter in peft's format, written atomically (temporary directory,
    then rename). An existing `root/name` is replaced."""
    return _write_dir(
        root, name, {"adapter_model.safetensors": tensors}, {"adapter_config.json": config}
    )


def write_weights_dir(root: Path, name: str, named: list[tuple[str, torch.Tensor]]) -> Path:
    """`root/name` holding weights as one safetensors file (what SGLang's update_weights_from_disk
    reads: any subset of the model's weights, by their checkpoint names), written atomically."""
    return _write_dir(root, name, {"model.safetensors": dict(named)}, {})


def _write_dir(
    root: Path, name: str, tensor_files: dict[str, dict], json_files: dict[str, dict]
) -> Path:
    def fill(tmp: Path) -> None:
        for file, tensors in tensor_files.items():
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / file))
        for file, data in json_files.items():
            (tmp / file).write_text(json.dumps(data, indent=2))

    return write_dir(root / name, fill, replace=True)
