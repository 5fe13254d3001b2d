"""Turn an Orbit/peft LoRA export into what SGLang 0.5.x loads correctly (CPU and GPU alike).

Orbit exports `peft.get_peft_model_state_dict(model)` (names unchanged, e.g.
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`) and the peft config dict.
SGLang takes those names as they are, and its q/k/v and gate/up merge (sglang/srt/lora/lora.py,
`normalize_qkv_proj`, `normalize_gate_up_proj`) is numerically right: measured against peft it
agrees to ~1e-5 in logprob on every target set that it accepts (docs/sglang.md). What it does not
accept is an adapter on *part* of a fused group:

- q/k/v are fused into `qkv_proj`. `normalize_qkv_proj` only starts from a `q_proj` weight and
  needs `v_proj` too ("We assume every lora adaptor should contain lora modules for q_proj"):
  q only -> the load fails with KeyError '...v_proj.lora_A.weight'; k only or v only -> the load
  *succeeds*, the unfused k/v weights stay under their own names, and the first request that
  uses the adapter kills the scheduler ("Cannot find target module name for ...k_proj... in
  {'qkv_proj', ...}"): the whole engine dies.
- gate/up are fused into `gate_up_proj`; a missing up_proj is zero-filled by SGLang, but an
  up_proj without gate_proj stays orphaned and fails the same way.
- SGLang's scaling is always `lora_alpha / r` (lora.py: `self.scaling`): `use_rslora`
  (alpha / sqrt(r)), `rank_pattern` and `alpha_pattern` are ignored; DoRA is not supported.

`to_sglang_lora` fills the missing members of a fused group with zero A and B (an exact zero
delta, so the adapter's function is unchanged), folds rsLoRA's scale into `lora_alpha`, and
rejects what SGLang would get wrong. Engines must be started with `lora_target_modules` covering
the completed groups: `sglang_target_modules(targets)`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping

import torch

FUSED_GROUPS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
)
_NAME = re.compile(r"^(?P<prefix>.*\.)(?P<module>[A-Za-z0-9_]+)\.(?P<ab>lora_[AB])\.weight$")


def sglang_target_modules(target_modules: Iterable[str]) -> list[str]:
    """The recipe's target modules with every fused group that one of them touches completed."""
    targets = set(target_modules)
    for group in FUSED_GROUPS:
        if targets & set(group):
            targets |= set(group)
    return sorted(targets)


def fused_out_features(model_config: Mapping | object) -> dict[str, int]:
    """Output width of each projection of a Llama/Qwen2-style decoder (for the zero B blocks)."""

    def get(key: str, default=None):
        if isinstance(model_config, Mapping):
            return model_config.get(key, default)
        return getattr(model_config, key, default)

    hidden = int(get("hidden_size"))
    heads = int(get("num_attention_heads"))
    kv_heads = int(get("num_key_value_heads") or heads)
    head_dim = int(get("head_dim") or hidden // heads)
    inter = int(get("intermediate_size"))
    return {
        "q_proj": heads * head_dim,
        "k_proj": kv_heads * head_dim,
        "v_proj": kv_heads * head_dim,
        "gate_proj": inter,
        "up_proj": inter,
    }


def to_sglang_lora(
    tensors: Mapping[str, torch.Tensor], config: Mapping, model_config: Mapping | object
) -> tuple[dict[str, torch.Tensor], dict]:
    """Return (tensors, config_dict) for `load_lora_adapter_from_tensors`.

    `tensors`/`config` are Orbit's export (peft names and peft's config dict); `model_config` is
    the base model's HF config (object or dict). Inputs are not modified.
    """
    cfg = dict(config)
    peft_type = str(cfg.get("peft_type", "LORA")).rsplit(".", 1)[-1].upper()
    if peft_type != "LORA":
        raise ValueError(
            f"SGLang serves LoRA adapters only, got peft_type {cfg.get('peft_type')!r}"
        )
    if cfg.get("use_dora"):
        raise ValueError("SGLang does not support DoRA adapters (use_dora=True)")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise ValueError(
            "SGLang ignores rank_pattern/alpha_pattern: export one r and lora_alpha for all modules"
        )
    if cfg.get("lora_bias"):
        raise ValueError("SGLang does not load LoRA bias terms (lora_bias=True)")
    r = int(cfg["r"])
    if cfg.get("use_rslora"):
        # peft scales by alpha / sqrt(r); SGLang always by lora_alpha / r.
        cfg["lora_alpha"] = float(cfg["lora_alpha"]) * math.sqrt(r)
        cfg["use_rslora"] = False

    out = dict(tensors)
    present: dict[str, set[str]] = {}  # layer prefix -> modules with lora_A and lora_B
    for name in tensors:
        m = _NAME.match(name)
        if m is None:
            continue
        present.setdefault(m["prefix"], set()).add(m["module"])
    widths = None
    for prefix, modules in present.items():
        for group in FUSED_GROUPS:
            have = modules & set(group)
            if not have or have == set(group):
                continue
            widths = widths or fused_out_features(model_config)
            a = next(tensors[f"{prefix}{mod}.lora_A.weight"] for mod in group if mod in have)
            for mod in group:
                if mod in have:
                    continue
                out[f"{prefix}{mod}.lora_A.weight"] = torch.zeros_like(a)
                out[f"{prefix}{mod}.lora_B.weight"] = torch.zeros(
                    widths[mod], r, dtype=a.dtype, device=a.device
                )
    targets = cfg.get("target_modules")
    if targets is not None and not isinstance(targets, str):
        cfg["target_modules"] = sglang_target_modules(targets)
    return out, cfg
