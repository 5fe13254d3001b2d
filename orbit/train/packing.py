"""Many adapters in one pass over the shared base: each row of a batch under its own adapter.

The base's matmuls run once on the whole pack; each adapted layer then adds, to each adapter's rows
only, that adapter's part: LoRA's `B A x` (peft's own mixed-batch code), OFT's rotation of the
input rows before the base matmul (peft has no mixed batch for OFT: written here, as peft's OFT
forward does it for one adapter). Gradients reach each adapter's parameters from its rows only, so a
row's logprob, and an adapter's gradient, are what a pass of its own would give.

peft offers the mixed batch at inference only: its model refuses `adapter_names` in training mode.
The layers themselves compute it differentiably; `Router` calls them so, layer by layer, for the
forwards run inside `rows(names)`. The output projection is left out of the router: its input is
the positions picked for the loss, not the batch's rows, and its chunks may be recomputed for the
backward after `rows` has ended (batch.token_logprobs' checkpointing), so a caller projects each
adapter's positions through `AdapterHead`, which carries its adapter with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeGuard

import torch
import torch.nn.functional as F
from peft.tuners.lora import LoraLayer
from peft.tuners.oft import OFTLayer
from torch import Tensor, nn

BASE = "__base__"  # a row with no adapter (peft's name for it): the frozen base model


def tuner_layers(model: nn.Module) -> list[nn.Module]:
    """Every peft LoRA or OFT layer of `model` (the modules that wrap a base layer)."""
    return [m for m in model.modules() if isinstance(m, LoraLayer | OFTLayer)]


def mixed_forward(
    layer: nn.Module, names: list[str], x: Tensor, *args: Any, **kwargs: Any
) -> Tensor:
    """`layer`'s output with row b of `x` computed under adapter names[b] (BASE: none). Rows of one
    adapter next to each other (as packs order them) make one block each: the layer splits `x`
    into views, not copies, and joins the blocks' parts with one concatenation, whose backward is
    one split (indexing each adapter's rows would copy them, and scatter their gradients back)."""
    if len(names) != x.shape[0]:
        raise ValueError(f"{len(names)} adapter names for a batch of {x.shape[0]} rows")
    if getattr(layer, "merged", False):
        raise ValueError("a packed pass needs unmerged adapters")
    blocks = _blocks(names)
    chunks = x.split([n for _, n in blocks])
    if isinstance(layer, LoraLayer):
        return _lora_mixed(layer, [name for name, _ in blocks], chunks, x, *args, **kwargs)
    return _oft_mixed(layer, [name for name, _ in blocks], chunks, x, *args, **kwargs)


def _blocks(names: list[str]) -> list[tuple[str, int]]:
    """(name, rows) of each run of equal names, in order."""
    out: list[tuple[str, int]] = []
    for name in names:
        if out and out[-1][0] == name:
            out[-1] = (name, out[-1][1] + 1)
        else:
            out.append((name, 1))
    return out


def _lora_mixed(
    layer: Any, names: list[str], chunks: tuple[Tensor, ...], x: Tensor, *args: Any, **kwargs: Any
) -> Tensor:
    """LoRA adds B A x (scaled) to the base's output (peft's Linear.forward): each block's own."""
    result = layer.base_layer(x, *args, **kwargs)
    parts = []
    for name, chunk in zip(names, chunks, strict=True):
        if name == BASE or name not in layer.lora_A:
            parts.append(result.new_zeros((*chunk.shape[:-1], result.shape[-1])))
            continue
        if name in layer.lora_variant or layer.lora_bias.get(name, False):
            raise NotImplementedError("a packed pass computes plain LoRA (no DoRA, no lora_bias)")
        a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
        low = F.linear(layer.lora_dropout[name](chunk.to(a.dtype)), a)
        # the scale on B's [out, r] weight, not on the [rows, out] output: one pass less over it
        parts.append(F.linear(low, b * layer.scaling[name]).to(result.dtype))
    return result + (parts[0] if len(parts) == 1 else torch.cat(parts))


def _oft_mixed(
    layer: Any, names: list[str], chunks: tuple[Tensor, ...], x: Tensor, *args: Any, **kwargs: Any
) -> Tensor:
    """OFT rotates a row's input before the base matmul (peft's OFT Linear.forward): each block by
    its own rotation, base rows not at all, then one base matmul for all of them."""
    dtype = x.dtype
    parts = []
    for name, chunk in zip(names, chunks, strict=True):
        if name == BASE or name not in layer.oft_R:
            parts.append(chunk)
            continue
        oft_r = layer.oft_R[name]
        parts.append(oft_r(layer._cast_input_dtype(chunk, oft_r.weight.dtype)).to(dtype))
    rotated = parts[0] if len(parts) == 1 else torch.cat(parts)
    return layer.base_layer(rotated, *args, **kwargs).to(dtype)


class Router:
    """Routes the rows of a batch to their adapters in every adapted layer of `model` but the output
    projection `head` (see the module's docstring)."""

    def __init__(self, model: nn.Module, head: nn.Module | None = None) -> None:
        self.layers = [m for m in tuner_layers(model) if m is not head]

    @contextmanager
    def rows(self, names: list[str]) -> Iterator[None]:
        """Forwards run inside compute row b with adapter names[b]. An instance's `forward`
        shadows its class's for the while (nn.Module calls `self.forward`)."""
        for layer in self.layers:
            layer.forward = partial(mixed_forward, layer, names)
        try:
            yield
        finally:
            for layer in self.layers:
                del layer.forward


@dataclass
class Route:
    """A packed pass: row b of the batch (a sequence; in batch.py, a prompt group and its
    samples) computes with adapter `names[b]`."""

    router: Router
    names: list[str]


def routed(route: Route | None, names: list[str]) -> AbstractContextManager[None]:
    """The forwards inside with row b under adapter names[b]; without a route, as peft runs them."""
    return route.router.rows(names) if route is not None else nullcontext()


class AdapterHead:
    """The output projection (a peft layer) computing with adapter `name` alone, whenever it is
    called: batch.token_logprobs' `head`, recomputed for the backward included."""

    def __init__(self, head: nn.Module, name: str) -> None:
        self.head, self.name = head, name
        self.out_features = head.out_features  # the vocabulary: token_logprobs sizes chunks by it

    def __call__(self, h: Tensor) -> Tensor:
        return mixed_forward(self.head, [self.name] * h.shape[0], h)


def adapted(module: object) -> TypeGuard[nn.Module]:
    """Whether `module` is a peft layer (so that a packed pass must route it)."""
    return isinstance(module, LoraLayer | OFTLayer)
