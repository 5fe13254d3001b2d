"""Checks shared by every engine backend: requests, pushed tensors, adapters, slots, versions.

A bad push or request is refused here, naming the first problem, before anything reaches an
engine (the embedded one or SGLang), so the engine keeps serving what it had.
"""

from __future__ import annotations

import enum
import re

import torch

from orbit.engine.base import ACTIVE, PAUSE_MODES, EngineError, SamplingParams, Slot
from orbit.engine.spec import HEAD, HEAD_LAYER, MODULES, ModelSpec


def check_tensor(name: str, t: object, shape: tuple[int, ...]) -> None:
    """Shared validation of pushed tensors: type, float dtype, shape, finiteness."""
    if not isinstance(t, torch.Tensor):
        raise EngineError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.dtype.is_floating_point:
        raise EngineError(f"{name}: dtype {t.dtype} is not a floating-point dtype")
    if tuple(t.shape) != tuple(shape):
        raise EngineError(f"{name}: shape {tuple(t.shape)} does not match expected {tuple(shape)}")
    if not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise EngineError(f"{name}: contains {bad} NaN/Inf value(s)")


def check_version(version: object) -> int:
    if isinstance(version, bool) or not isinstance(version, int):
        raise EngineError(f"version must be an int, got {version!r}")
    return version


def check_ids(ids: list, vocab: int, what: str) -> list[int]:
    """Token ids must be ints in [0, vocab): an id outside kills SGLang's scheduler."""
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise EngineError(f"{what} token {t!r} is not an id in [0, {vocab})")
    return ids


def check_prompt(prompt_ids: object, vocab: int, max_context: int) -> list[int]:
    """A prompt: token ids in the vocabulary, leaving room for at least one generated token."""
    prompt = check_ids(list(prompt_ids), vocab, "prompt")  # type: ignore[call-overload]
    if not prompt:
        raise EngineError("prompt_ids is empty")
    if len(prompt) >= max_context:
        raise EngineError(
            f"prompt has {len(prompt)} tokens; the engine context is {max_context} (the prompt "
            "must leave room for at least one generated token)"
        )
    return prompt


def check_scoring(sampling: SamplingParams, prompt: list[int], vocab: int) -> None:
    """What a request asks to be scored: one row of target tokens per prompt position after the
    first, each an id in the vocabulary (the rest of `sampling`: SamplingParams.check)."""
    targets = sampling.prompt_targets
    if targets is None:
        return
    if len(targets) != len(prompt) - 1:
        raise EngineError(
            f"prompt_targets has {len(targets)} rows; the prompt has {len(prompt) - 1} positions "
            "after its first"
        )
    for row in targets:
        check_ids(list(row), vocab, "prompt_targets")


def check_request_slot(slot: object, num_slots: int) -> Slot:
    """What `generate` takes as a slot: 'active', None (the base model) or a slot index."""
    if not (
        slot == ACTIVE
        or slot is None
        or (isinstance(slot, int) and not isinstance(slot, bool) and 0 <= slot < num_slots)
    ):
        raise EngineError(f"slot must be 'active', None or one of 0..{num_slots - 1}, got {slot!r}")
    return slot


def check_pause_mode(mode: object) -> str:
    if mode not in PAUSE_MODES:
        raise EngineError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
    return mode


_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)"
    r"\.(lora_A|lora_B|oft_R)\.weight$"
)
_HEAD_NAME = re.compile(r"^base_model\.model\.lm_head\.(lora_A|lora_B)\.weight$")
# Config options that change the math; anything but the default is refused, not ignored.
_LORA_MUST_BE_OFF = (
    "use_dora",
    "lora_bias",
    "modules_to_save",
    "rank_pattern",
    "alpha_pattern",
    "fan_in_fan_out",
    "layer_replication",
    "trainable_token_indices",
    "use_qalora",
    "alora_invocation_tokens",
    "target_parameters",
    "use_bdlora",
    "arrow_config",
    "kasa_config",
    "megatron_config",
)
_OFT_MUST_BE_OFF = ("modules_to_save", "fan_in_fan_out")


def plain_config(config: object) -> dict:
    """An adapter config as plain JSON values: peft's to_dict() holds enums (PeftType) and sets."""
    if not isinstance(config, dict):
        raise EngineError(
            f"adapter_config must be a dict (peft_config.to_dict()), got {type(config).__name__}"
        )
    out = {}
    for key, value in config.items():
        value = value.value if isinstance(value, enum.Enum) else value
        out[key] = sorted(value) if isinstance(value, set | frozenset) else value
    return out


def _adjust_oft(in_features: int, params: int) -> int:
    """peft 0.21's OFTLayer.adjust_oft_parameters: nearest divisor of in_features."""
    if params < in_features:
        higher = params
        while higher <= in_features and in_features % higher != 0:
            higher += 1
    else:
        return in_features
    lower = params
    while lower > 1 and in_features % lower != 0:
        lower -= 1
    return lower if (params - lower) <= (higher - params) else higher


def oft_layout(config: dict, in_features: int) -> tuple[int, int]:
    """(number of blocks, block size) exactly as peft derives them for a layer."""
    r, bs = int(config.get("r", 0) or 0), int(config.get("oft_block_size", 0) or 0)
    if r == 0 and bs != 0:
        if in_features % bs != 0 or bs > in_features:
            bs = _adjust_oft(in_features, bs)
        return in_features // bs, bs
    if r != 0 and bs == 0:
        if in_features % r != 0 or r > in_features:
            r = _adjust_oft(in_features, r)
        return r, in_features // r
    raise EngineError(
        f"OFT config needs exactly one of r and oft_block_size non-zero, got r={r}, "
        f"oft_block_size={bs}"
    )


def _check_options(kind: str, config: dict, engine: str = "the embedded engine") -> None:
    for opt in _LORA_MUST_BE_OFF if kind == "lora" else _OFT_MUST_BE_OFF:
        if config.get(opt):
            raise EngineError(
                f"adapter config option {opt}={config[opt]!r} is not supported by {engine}"
            )
    if config.get("bias", "none") != "none":
        raise EngineError(f"adapter config bias={config['bias']!r} is not supported (only 'none')")
    if kind == "lora" and not int(config.get("r", 0) or 0) > 0:
        raise EngineError(f"LoRA config needs r > 0, got {config.get('r')!r}")


def _expected_modules(config: dict, spec: ModelSpec) -> set[tuple[int, str]] | None:
    """(layer, module) pairs a list-valued target_modules promises; None when it is a regex."""
    targets = config.get("target_modules")
    if not isinstance(targets, list | tuple | set | frozenset):
        return None
    layers = config.get("layers_to_transform")
    if isinstance(layers, int):
        layers = [layers]
    layer_ids = layers if layers else range(spec.num_layers)
    excluded = config.get("exclude_modules") or ()
    if isinstance(excluded, str):
        return None  # a regex: peft's matching decides, the tensors tell us what it chose
    wanted = [
        m
        for m in MODULES
        if (m.split(".")[-1] in targets or m in targets)
        and not (m.split(".")[-1] in excluded or m in excluded)
    ]
    head = {(HEAD_LAYER, HEAD)} if HEAD in targets and HEAD not in excluded else set()
    return {(i, m) for i in layer_ids for m in wanted} | head


def check_adapter(
    tensors: dict[str, torch.Tensor],
    config: dict,
    spec: ModelSpec,
    engine: str = "the embedded engine",
) -> tuple[str, dict[tuple[int, str], dict[str, torch.Tensor]]]:
    """Validate a peft state dict + config against a model: names, shapes, dtype, NaN/Inf, options.

    Returns (kind "lora"/"oft", {(layer, module): {part: tensor}}). Raises EngineError naming the
    first problem; changes nothing. Shared by the embedded engine and the SGLang backend, so a bad
    push is refused before anything reaches either engine.
    """
    config = plain_config(config)
    peft_type = str(config.get("peft_type")).removeprefix("PeftType.")
    kinds = {"LORA": "lora", "OFT": "oft"}
    if peft_type not in kinds:
        raise EngineError(f"unsupported peft_type {peft_type!r}; {engine} serves LORA and OFT")
    kind = kinds[peft_type]
    _check_options(kind, config, engine)
    if not isinstance(tensors, dict) or not tensors:
        raise EngineError("adapter has no tensors")
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        head = _HEAD_NAME.match(name) if isinstance(name, str) and kind == "lora" else None
        if head is not None:  # a LoRA on the output projection (Tinker's train_unembed)
            found.setdefault((HEAD_LAYER, HEAD), {})[head.group(1)] = t
            continue
        m = _NAME.match(name) if isinstance(name, str) else None
        if m is None or int(m.group(1)) >= spec.num_layers:
            raise EngineError(
                f"unknown adapter tensor name {name!r} (expected peft names like "
                "'base_model.model.model.layers.<i>.self_attn.q_proj.lora_A.weight', layer < "
                f"{spec.num_layers})"
            )
        part = m.group(3)
        if (part == "oft_R") != (kind == "oft"):
            raise EngineError(f"tensor {name!r} does not belong to a {peft_type} adapter")
        found.setdefault((int(m.group(1)), m.group(2)), {})[part] = t
    expected = _expected_modules(config, spec)
    if expected is not None and expected - set(found):
        layer, module = sorted(expected - set(found))[0]
        raise EngineError(
            f"adapter lacks tensors for layer {layer} {module} named by target_modules"
        )
    prefix = "base_model.model.model.layers"
    for (layer, module), parts in found.items():
        out_f, in_f = spec.module_shape(module)
        name = "base_model.model.lm_head" if module == HEAD else f"{prefix}.{layer}.{module}"
        if kind == "lora":
            r = int(config["r"])
            for part, shape in (("lora_A", (r, in_f)), ("lora_B", (out_f, r))):
                if part not in parts:
                    raise EngineError(f"{name}: has {sorted(parts)} but lacks {part}")
                check_tensor(f"{name}.{part}.weight", parts[part], shape)
        else:
            blocks, size = oft_layout(config, in_f)
            rows = 1 if config.get("block_share") else blocks
            check_tensor(f"{name}.oft_R.weight", parts["oft_R"], (rows, size * (size - 1) // 2))
    return kind, found


def check_slot(slot: object, num_slots: int = 2) -> int:
    if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < num_slots:
        raise EngineError(f"slot must be one of 0..{num_slots - 1}, got {slot!r}")
    return slot
