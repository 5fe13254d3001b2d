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
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from orbit.engine.checks import check_adapter, oft_layout
from orbit.engine.embedded.model import GROUPS, HeadDelta, Linear
from orbit.engine.spec import HEAD, HEAD_LAYER, ModelSpec

NUM_SLOTS = 2  # the default: the classic double buffer (engine.slots)


@dataclass
class LoraGroup:
    a: torch.Tensor  # [sum of ranks, in]
    b: torch.Tensor  # [group out, sum of ranks], block diagonal, scale folded in

    def apply(
        self, lin: Linear, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor | None
    ) -> None:
        delta = F.linear(F.linear(x, self.a), self.b)
        if idx is None:
            y.add_(delta)
        else:
            y.index_add_(0, idx, delta)


@dataclass
class OftGroup:
    rotations: tuple[torch.Tensor | None, ...]  # per member of the group: [blocks, bs, bs] or None

    def apply(
        self, lin: Linear, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor | None
    ) -> None:
        for (_, start, end), rot in zip(lin.parts, self.rotations, strict=True):
            if rot is None:  # member not targeted: the base output already in y is right
                continue
            blocks, size = rot.shape[0], rot.shape[1]
            # peft rotates in the adapter's float32, then casts back for the base linear
            xr = torch.einsum("nrk,rkc->nrc", x.float().view(-1, blocks, size), rot).reshape(
                x.shape
            )
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
    # group name -> adapter
    layers: list[dict[str, LoraGroup | OftGroup]] = field(default_factory=list)
    head: LoraGroup | None = None  # a LoRA on the output projection

    def to(self, device: torch.device) -> SlotWeights:
        def move(g: LoraGroup | OftGroup) -> LoraGroup | OftGroup:
            if isinstance(g, LoraGroup):
                return LoraGroup(g.a.to(device), g.b.to(device))
            return OftGroup(tuple(None if r is None else r.to(device) for r in g.rotations))

        head = (
            None if self.head is None else LoraGroup(self.head.a.to(device), self.head.b.to(device))
        )
        return SlotWeights(
            self.kind,
            self.version,
            [{k: move(g) for k, g in lay.items()} for lay in self.layers],
            head,
        )


class SlotBatch:
    """The slots used by one forward, each with the flattened token rows it applies to.

    `idx=None` means every row (the common case of a batch on one slot: no gather/scatter).
    Rows bound to no slot simply get the base projection.
    """

    def __init__(self, entries: list[tuple[SlotWeights, torch.Tensor | None]]) -> None:
        self.entries = entries

    def head(self) -> HeadDelta | None:
        """What the output projection adds to the logits of the rows whose slot has a LoRA on it
        (None: no such slot in the batch): called with the normed hidden states and the logits."""
        todo = [(w.head, idx) for w, idx in self.entries if w.head is not None]
        if not todo:
            return None

        def add(x: torch.Tensor, logits: torch.Tensor) -> None:
            for adapter, idx in todo:
                delta = F.linear(
                    F.linear(x if idx is None else x.index_select(0, idx), adapter.a), adapter.b
                )
                if idx is None:
                    logits.add_(delta)
                else:
                    logits.index_add_(0, idx, delta)

        return add

    def project(self, layer: int, group: str, lin: Linear, x: torch.Tensor) -> torch.Tensor:
        todo = [
            (w.layers[layer][group], idx) for w, idx in self.entries if group in w.layers[layer]
        ]
        y = F.linear(x, lin.weight, lin.bias)
        for adapter, idx in todo:
            adapter.apply(lin, x if idx is None else x.index_select(0, idx), y, idx)
        return y


# ---- loading ------------------------------------------------------------------------------------


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


def parse_adapter(
    tensors: dict[str, torch.Tensor],
    config: dict,
    version: int,
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device,
) -> SlotWeights:
    """Validate a peft state dict + config and build the slot contents. Raises EngineError."""
    kind, found = check_adapter(tensors, config, spec)
    return _build(kind, found, config, version, spec, dtype, device)


def _build(
    kind: str,
    found: dict[tuple[int, str], dict[str, torch.Tensor]],
    config: dict,
    version: int,
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device,
) -> SlotWeights:
    layers: list[dict[str, LoraGroup | OftGroup]] = [{} for _ in range(spec.num_layers)]
    for layer in range(spec.num_layers):
        for group, members in GROUPS.items():
            present = [m for m in members if (layer, m) in found]
            if not present:
                continue
            if kind == "lora":
                layers[layer][group] = _lora_group(
                    members, {m: found[(layer, m)] for m in present}, config, spec, dtype, device
                )
            else:
                rots: list[torch.Tensor | None] = []
                for m in members:
                    if (layer, m) not in found:
                        rots.append(None)
                        continue
                    blocks, size = oft_layout(config, spec.module_shape(m)[1])
                    rot = oft_rotation(
                        found[(layer, m)]["oft_R"].detach().float().cpu(), size, config
                    )
                    if config.get("block_share"):
                        rot = rot.repeat(blocks, 1, 1)
                    rots.append(rot.to(device=device).contiguous())  # float32, as peft keeps it
                layers[layer][group] = OftGroup(tuple(rots))
    head = None
    if (HEAD_LAYER, HEAD) in found:  # LoRA only (check_adapter): B [vocab, r] scaled, as a group's
        head = _lora_group((HEAD,), {HEAD: found[(HEAD_LAYER, HEAD)]}, config, spec, dtype, device)
    return SlotWeights(kind, version, layers, head)  # type: ignore[arg-type]


def _lora_group(
    members: tuple[str, ...],
    parts: dict[str, dict[str, torch.Tensor]],
    config: dict,
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device,
) -> LoraGroup:
    r, alpha = int(config["r"]), float(config.get("lora_alpha", 8))
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    present = [m for m in members if m in parts]
    a = torch.cat([parts[m]["lora_A"].detach().float().cpu() for m in present])
    b = torch.zeros(sum(spec.module_shape(m)[0] for m in members), r * len(present))
    row = col = 0
    for m in members:  # member m's B fills its output rows and its own rank columns
        out = spec.module_shape(m)[0]
        if m in parts:
            b[row : row + out, col : col + r] = parts[m]["lora_B"].detach().float().cpu() * scale
            col += r
        row += out
    return LoraGroup(a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype))
