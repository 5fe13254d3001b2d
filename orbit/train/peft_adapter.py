"""LoRA and OFT on the trainer side: peft configs, and merged weights for the full push. (What the
adapter push exports, peft's own state dict and config, is the trainer's:
orbit/train/trainer.py.)"""

from __future__ import annotations

import json
from math import gcd

import peft
import torch
from peft.tuners.lora import LoraLayer
from peft.tuners.oft import OFTLayer
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from orbit.config import AdapterConfig

_BASE_LAYER = "base_layer."


def peft_config(adapter: AdapterConfig, model: nn.Module | None = None) -> peft.PeftConfig:
    """The peft config for `adapter`. Pass the base model to check OFT's block size against it."""
    targets = list(adapter.target_modules)
    if adapter.type == "lora":
        return peft.LoraConfig(
            r=adapter.r,
            lora_alpha=adapter.alpha,
            lora_dropout=adapter.dropout,
            target_modules=targets,
            task_type="CAUSAL_LM",
        )
    if model is not None:
        check_oft_block_size(adapter, model)
    # r=0: peft derives the number of blocks per layer from oft_block_size (one of the two must be
    # 0).
    return peft.OFTConfig(
        r=0,
        oft_block_size=adapter.oft_block_size,
        module_dropout=adapter.dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )


def target_in_features(model: nn.Module, target_modules: list[str]) -> dict[str, int]:
    """in_features of every nn.Linear that peft would wrap (matched by name suffix, as peft
    does)."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.rpartition(".")[2] in target_modules:
            found[name] = module.in_features
    return found


def check_oft_block_size(adapter: AdapterConfig, model: nn.Module) -> None:
    """Raise ValueError unless oft_block_size divides every target's in_features.

    peft only warns and silently picks another block size per layer, which would give adapters
    whose shapes differ from what the recipe asked for.
    """
    sizes = target_in_features(model, list(adapter.target_modules))
    bs = adapter.oft_block_size
    bad = sorted({n for n in sizes.values() if n % bs != 0})
    if not bad:
        return
    common = 0
    for n in sizes.values():
        common = gcd(common, n)
    allowed = [d for d in range(2, min(common, 1024) + 1) if common % d == 0]
    raise ValueError(
        f"adapter.oft_block_size: {bs} does not divide in_features {bad} of target_modules "
        f"{list(adapter.target_modules)}; allowed values: "
        f"{allowed or 'none (choose other target_modules)'}"
    )


def merged_weights(
    peft_model: peft.PeftModel, only_adapted: bool = False
) -> dict[str, torch.Tensor]:
    """The full base state dict under the checkpoint's own names, adapter merged in.

    Computed functionally from each base weight and peft's `get_delta_weight`: the model is never
    merged in place (OFT's unmerge inverts a matrix and drifts). Tied weights appear once, under
    the first name, as in the saved checkpoint. Every tensor is a fresh CPU copy.

    `only_adapted=True`: just the merged weight matrices of the modules the adapter wraps (the
    only ones it changes), e.g. for pushing an OFT policy to an engine that serves LoRA only.
    """
    base = peft_model.get_base_model()
    tuners = {name: m for name, m in base.named_modules() if isinstance(m, BaseTunerLayer)}
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    with torch.no_grad():
        for key, tensor in base.state_dict().items():
            owner, rest = _tuner_owner(key, tuners)
            if owner is not None and not rest.startswith(_BASE_LAYER):
                continue  # the adapter's own parameters
            if only_adapted and (owner is None or rest != _BASE_LAYER + "weight"):
                continue  # unchanged by the adapter (biases too: LoRA and OFT leave them alone)
            if tensor.data_ptr() in seen:
                continue  # a tied weight, already emitted under its first name
            seen.add(tensor.data_ptr())
            if owner is None:
                out[key] = tensor.detach().to("cpu", copy=True).contiguous()
                continue
            param = rest[len(_BASE_LAYER) :]
            if param == "weight":
                tensor = _merged_weight(tuners[owner])
            out[f"{owner}.{param}"] = tensor.detach().to("cpu", copy=True).contiguous()
    return out


def _tuner_owner(key: str, tuners: dict[str, BaseTunerLayer]) -> tuple[str | None, str]:
    """Split a state-dict key into (tuner layer name, rest) when a peft layer owns it."""
    parts = key.split(".")
    for i in range(1, len(parts)):
        prefix = ".".join(parts[:i])
        if prefix in tuners:
            return prefix, ".".join(parts[i:])
    return None, key


def _merged_weight(layer: BaseTunerLayer) -> torch.Tensor:
    """What peft's in-place `merge` would leave in the base weight, computed out of place."""
    weight = layer.get_base_layer().weight
    for name in layer.active_adapters:
        if isinstance(layer, LoraLayer) and name in layer.lora_A:
            if name in layer.lora_variant or layer.lora_bias[name]:
                raise NotImplementedError(
                    "merged_weights supports plain LoRA (no DoRA, no lora_bias)"
                )
            weight = weight + layer.get_delta_weight(name).to(weight.dtype)
        elif isinstance(layer, OFTLayer) and name in layer.oft_R:
            # OFT rotates the input rows, y = (x R) W^T, so the merged weight is W R^T, as peft's
            # merge.
            rotation = layer.get_delta_weight(name)
            weight = torch.mm(rotation, weight.t().to(rotation.dtype)).t().to(weight.dtype)
    return weight


def adapter_tensors(peft_model: peft.PeftModel, name: str = "default") -> dict[str, torch.Tensor]:
    """Adapter `name`'s weights under peft's names (as for a model's one adapter), as detached
    contiguous CPU copies. Only the adapter's own: with a LoRA on the output projection peft would
    add the whole projection (its "embedding layers"), which is the base's."""
    state = peft.get_peft_model_state_dict(
        peft_model, adapter_name=name, save_embedding_layers=False
    )
    return {name: t.detach().to("cpu", copy=True).contiguous() for name, t in state.items()}


def adapter_config_dict(peft_model: peft.PeftModel, name: str = "default") -> dict:
    """Adapter `name`'s peft config as plain JSON types (the adapter_config.json contents)."""
    config = peft_model.peft_config[name].to_dict()
    for key, value in config.items():
        # save_pretrained turns sets into lists too; sort for stable output
        if isinstance(value, set):
            config[key] = sorted(value)
    return json.loads(json.dumps(config))  # enums -> str, tuples -> lists
