"""Adapter slots: peft's own LoRA/OFT state dicts, validated, prepared once, applied per row.

A slot is filled from exactly what the trainer has: `peft.get_peft_model_state_dict(model)` (names
unchanged, e.g. `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`) and
`peft_config.to_dict()`. Loading validates everything before anything is built, so a bad push
raises EngineError and the slot keeps serving its previous contents.

Prepared forms (per layer, per fused projection group of model.GROUPS):
- LoRA: the members' A stacked [sum r, in] and a block-diagonal B·scale [group out, sum r], so a
  group's delta is two matmuls whatever the number of targeted members.
- OFT: per member, the block rotations [blocks, bs, bs] computed once here (Cayley or
  Cayley-Neumann, exactly peft 0.21's OFTRotationModule); at run time the input is rotated block
  by block and the base linear (bias included) runs on it.

`SlotBatch` applies the slots of a mixed batch by row index selection, one pass per slot in use.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from orbit.engine.base import EngineError
from orbit.engine.embedded.model import GROUPS, MODULES, Linear, ModelSpec, check_tensor

NUM_SLOTS = 2  # the default: the classic double buffer (engine.slots)
_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)"
    r"\.(lora_A|lora_B|oft_R)\.weight$"
)
_GROUP_OF = {m: g for g, members in GROUPS.items() for m in members}

# Config options that change the math; anything but the default is refused, not ignored.
_LORA_MUST_BE_OFF = ("use_dora", "lora_bias", "modules_to_save", "rank_pattern", "alpha_pattern",
                     "fan_in_fan_out", "layer_replication", "trainable_token_indices", "use_qalora",
                     "alora_invocation_tokens", "target_parameters", "use_bdlora", "arrow_config",
                     "kasa_config", "megatron_config")
_OFT_MUST_BE_OFF = ("modules_to_save", "fan_in_fan_out")


@dataclass
class LoraGroup:
    a: torch.Tensor  # [sum of ranks, in]
    b: torch.Tensor  # [group out, sum of ranks], block diagonal, scale folded in

    def apply(self, lin: Linear, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor | None) -> None:
        delta = F.linear(F.linear(x, self.a), self.b)
        if idx is None:
            y.add_(delta)
        else:
            y.index_add_(0, idx, delta)


@dataclass
class OftGroup:
    rotations: tuple[torch.Tensor | None, ...]  # per member of the group: [blocks, bs, bs] or None

    def apply(self, lin: Linear, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor | None) -> None:
        for (_, start, end), rot in zip(lin.parts, self.rotations, strict=True):
            if rot is None:  # member not targeted: the base output already in y is right
                continue
            blocks, size = rot.shape[0], rot.shape[1]
            # peft rotates in the adapter's float32, then casts back for the base linear
            xr = torch.einsum("nrk,rkc->nrc", x.float().view(-1, blocks, size), rot).reshape(x.shape)
            xr = xr.to(x.dtype)
            bias = None if lin.bias is None else lin.bias[start:end]
            out = F.linear(xr, lin.weight[start:end], bias)
            if idx is None:
                y[:, start:end] = out
            else:
                y[:, start:end].index_copy_(0, idx, out)


@dataclass
class SlotWeights:
    """One loaded adapter, ready to apply."""

    kind: Literal["lora", "oft"]
    version: int
    layers: list[dict[str, LoraGroup | OftGroup]] = field(default_factory=list)  # group name -> adapter

    def to(self, device: torch.device) -> SlotWeights:
        def move(g: LoraGroup | OftGroup) -> LoraGroup | OftGroup:
            if isinstance(g, LoraGroup):
                return LoraGroup(g.a.to(device), g.b.to(device))
            return OftGroup(tuple(None if r is None else r.to(device) for r in g.rotations))

        return SlotWeights(self.kind, self.version, [{k: move(g) for k, g in lay.items()} for lay in self.layers])


class SlotBatch:
    """The slots used by one forward, each with the flattened token rows it applies to.

    `idx=None` means every row (the common case of a batch on one slot: no gather/scatter).
    Rows bound to no slot simply get the base projection.
    """

    def __init__(self, entries: list[tuple[SlotWeights, torch.Tensor | None]]) -> None:
        self.entries = entries

    def project(self, layer: int, group: str, lin: Linear, x: torch.Tensor) -> torch.Tensor:
        todo = [(w.layers[layer][group], idx) for w, idx in self.entries if group in w.layers[layer]]
        y = F.linear(x, lin.weight, lin.bias)
        for adapter, idx in todo:
            adapter.apply(lin, x if idx is None else x.index_select(0, idx), y, idx)
        return y


# ---- loading ------------------------------------------------------------------------------------


def _plain(value: object) -> object:
    """peft puts enums (PeftType) and sets in to_dict(); compare on plain values."""
    return getattr(value, "value", value)


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
    raise EngineError(f"OFT config needs exactly one of r and oft_block_size non-zero, got r={r}, "
                      f"oft_block_size={bs}")


def _skew(vec: torch.Tensor, size: int) -> torch.Tensor:
    rows, cols = torch.triu_indices(size, size, 1)
    m = torch.zeros(vec.shape[0], size, size, dtype=vec.dtype)
    m[:, rows, cols] = vec
    return m - m.transpose(-2, -1)


def _coft_project(vec: torch.Tensor, size: int, eps: float) -> torch.Tensor:
    """peft's OFTRotationModule._project_batch (the constrained variant, COFT)."""
    q = _skew(vec, size)
    eps = eps / math.sqrt(q.shape[0])
    norm = torch.norm(q, dim=(1, 2), keepdim=True)
    out = torch.where(norm <= eps, q, eps * (q / norm))
    rows, cols = torch.triu_indices(size, size, 1)
    return out[:, rows, cols]


def oft_rotation(vec: torch.Tensor, size: int, config: dict) -> torch.Tensor:
    """Block rotations [b, size, size] from peft's upper-triangle vectors [b, n] (in float32)."""
    if config.get("coft"):
        vec = _coft_project(vec, size, float(config.get("eps", 6e-5)))
    q = _skew(vec, size)
    b = q.shape[0]
    if config.get("use_cayley_neumann", True):
        terms = int(config.get("num_cayley_neumann_terms", 5))
        rot = torch.eye(size, dtype=q.dtype).repeat(b, 1, 1)
        if terms > 1:  # the series exactly as peft truncates it (last term has weight 1)
            rot.add_(q, alpha=2.0)
            if terms > 2:
                q2 = torch.bmm(q, q)
                rot.add_(q2, alpha=2.0)
                power = q2
                for _ in range(3, terms - 1):
                    power = torch.bmm(power, q)
                    rot.add_(power, alpha=2.0)
                power = torch.bmm(power, q)
                rot.add_(power)
        return rot
    eye = torch.eye(size, dtype=q.dtype).expand(b, size, size)
    return torch.linalg.solve(eye + q, eye - q, left=False)


def _check_options(kind: str, config: dict, engine: str = "the embedded engine") -> None:
    for opt in _LORA_MUST_BE_OFF if kind == "lora" else _OFT_MUST_BE_OFF:
        if config.get(opt):
            raise EngineError(f"adapter config option {opt}={config[opt]!r} is not supported by {engine}")
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
    wanted = [m for m in MODULES if (m.split(".")[-1] in targets or m in targets)
              and not (m.split(".")[-1] in excluded or m in excluded)]
    return {(i, m) for i in layer_ids for m in wanted}


def check_adapter(tensors: dict[str, torch.Tensor], config: dict, spec: ModelSpec,
                  engine: str = "the embedded engine") -> tuple[str, dict[tuple[int, str], dict[str, torch.Tensor]]]:
    """Validate a peft state dict + config against a model: names, shapes, dtype, NaN/Inf, options.

    Returns (kind "lora"/"oft", {(layer, module): {part: tensor}}). Raises EngineError naming the
    first problem; changes nothing. Shared by the embedded engine and the SGLang backend, so a bad
    push is refused before anything reaches either engine.
    """
    if not isinstance(config, dict):
        raise EngineError(f"adapter_config must be a dict (peft_config.to_dict()), got {type(config).__name__}")
    peft_type = str(_plain(config.get("peft_type"))).removeprefix("PeftType.")
    kinds = {"LORA": "lora", "OFT": "oft"}
    if peft_type not in kinds:
        raise EngineError(f"unsupported peft_type {peft_type!r}; {engine} serves LORA and OFT")
    kind = kinds[peft_type]
    _check_options(kind, config, engine)
    if not isinstance(tensors, dict) or not tensors:
        raise EngineError("adapter has no tensors")
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = _NAME.match(name) if isinstance(name, str) else None
        if m is None or int(m.group(1)) >= spec.num_layers:
            raise EngineError(f"unknown adapter tensor name {name!r} (expected peft names like "
                              f"'base_model.model.model.layers.<i>.self_attn.q_proj.lora_A.weight', "
                              f"layer < {spec.num_layers})")
        part = m.group(3)
        if (part == "oft_R") != (kind == "oft"):
            raise EngineError(f"tensor {name!r} does not belong to a {peft_type} adapter")
        found.setdefault((int(m.group(1)), m.group(2)), {})[part] = t
    expected = _expected_modules(config, spec)
    if expected is not None and expected - set(found):
        layer, module = sorted(expected - set(found))[0]
        raise EngineError(f"adapter lacks tensors for layer {layer} {module} named by target_modules")
    prefix = "base_model.model.model.layers"
    for (layer, module), parts in found.items():
        out_f, in_f = spec.module_shape(module)
        name = f"{prefix}.{layer}.{module}"
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


def parse_adapter(tensors: dict[str, torch.Tensor], config: dict, version: int, spec: ModelSpec,
                  dtype: torch.dtype, device: torch.device) -> SlotWeights:
    """Validate a peft state dict + config and build the slot contents. Raises EngineError."""
    kind, found = check_adapter(tensors, config, spec)
    return _build(kind, found, config, version, spec, dtype, device)


def _build(kind: str, found: dict[tuple[int, str], dict[str, torch.Tensor]], config: dict, version: int,
           spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> SlotWeights:
    layers: list[dict[str, LoraGroup | OftGroup]] = [{} for _ in range(spec.num_layers)]
    for layer in range(spec.num_layers):
        for group, members in GROUPS.items():
            present = [m for m in members if (layer, m) in found]
            if not present:
                continue
            if kind == "lora":
                layers[layer][group] = _lora_group(members, {m: found[(layer, m)] for m in present},
                                                   config, spec, dtype, device)
            else:
                rots = []
                for m in members:
                    if (layer, m) not in found:
                        rots.append(None)
                        continue
                    blocks, size = oft_layout(config, spec.module_shape(m)[1])
                    rot = oft_rotation(found[(layer, m)]["oft_R"].detach().float().cpu(), size, config)
                    if config.get("block_share"):
                        rot = rot.repeat(blocks, 1, 1)
                    rots.append(rot.to(device=device).contiguous())  # float32, as peft keeps it
                layers[layer][group] = OftGroup(tuple(rots))
    return SlotWeights(kind, version, layers)  # type: ignore[arg-type]


def _lora_group(members: tuple[str, ...], parts: dict[str, dict[str, torch.Tensor]], config: dict,
                spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> LoraGroup:
    r, alpha = int(config["r"]), float(config.get("lora_alpha", 8))
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    present = [m for m in members if m in parts]
    a = torch.cat([parts[m]["lora_A"].detach().float().cpu() for m in present])
    b = torch.zeros(sum(spec.module_shape(m)[0] for m in members), r * len(present))
    row = col = 0
    for m in members:  # member m's B fills its output rows and its own rank columns
        out = spec.module_shape(m)[0]
        if m in parts:
            b[row:row + out, col:col + r] = parts[m]["lora_B"].detach().float().cpu() * scale
            col += r
        row += out
    return LoraGroup(a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype))


def check_slot(slot: object, num_slots: int = NUM_SLOTS) -> int:
    if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < num_slots:
        raise EngineError(f"slot must be one of 0..{num_slots - 1}, got {slot!r}")
    return slot
