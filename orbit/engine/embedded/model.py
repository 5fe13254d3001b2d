"""Our own decoder for Llama/Qwen2/Qwen3-family Hugging Face checkpoints.

Reads config.json + model.safetensors (or a sharded model.safetensors.index.json) and runs the
forward pass with plain tensors, no nn.Module: on a tiny model the per-op Python overhead is the
cost, so the projections that share an input run as one matmul (q|k|v, gate|up) and adapters act
on the slices (see slots.py). Weights stay addressable by their HF names (`params()`), as views
into the fused tensors, so `update_weights` writes them in place.

Numerics follow transformers' Llama/Qwen2/Qwen3 code: RMSNorm in float32, RoPE tables computed in
float32 from the checkpoint's rope settings and cast to the engine dtype, grouped-query attention
with scale head_dim**-0.5. Qwen3 adds a per-head RMSNorm of q and of k between the projection and
rope, and its head_dim need not be hidden_size / num_attention_heads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from orbit.engine.base import EngineError
from orbit.engine.checks import check_tensor
from orbit.engine.spec import DTYPES, MODULES, ModelSpec, checkpoint_files, read_spec

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
# Architectures with `self_attn.q_norm` / `self_attn.k_norm` (RMSNorm over head_dim, per head).
QK_NORM_MODEL_TYPES = ("qwen3",)

# Projections that read the same input run fused; adapters address the member modules.
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}
assert tuple(m for members in GROUPS.values() for m in members) == MODULES  # the checks' order


def unsupported(spec: ModelSpec, raw: dict) -> str | None:
    """Why this decoder cannot run a checkpoint (None: it can)."""
    if spec.model_type not in SUPPORTED_MODEL_TYPES:
        return (
            f"it is a {spec.model_type!r} model; the embedded engine runs "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if raw.get("hidden_act", "silu") != "silu":
        return f"hidden_act {raw['hidden_act']!r} is not supported (silu only)"
    if raw.get("use_sliding_window"):
        return "sliding-window attention is not supported by the embedded engine"
    if _rope_parameters(raw).get("partial_rotary_factor", 1.0) != 1.0:
        return "partial_rotary_factor != 1 is not supported"
    return None


def _rope_parameters(raw: dict) -> dict:
    """New-style `rope_parameters`, or the older `rope_theta` + `rope_scaling` pair."""
    if raw.get("rope_parameters"):
        return dict(raw["rope_parameters"])
    params = dict(raw.get("rope_scaling") or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    return params


def rope_frequencies(
    path: str | Path, raw: dict, spec: ModelSpec, max_context: int
) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention_scaling) for the checkpoint's rope settings.

    The default type is computed here (the formula of transformers' compute_default_rope_parameters)
    so the engine process does not pay the ~3 s transformers import; every other type comes from
    transformers' ROPE_INIT_FUNCTIONS with the HF config object.
    """
    params = _rope_parameters(raw)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        dim = spec.head_dim
        inv_freq = 1.0 / (
            params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
        )
        return inv_freq, 1.0
    # dynamic/longrope switch frequencies by sequence length; a static table matches them only
    # while every sequence stays within the original length.
    original = params.get("original_max_position_embeddings", spec.max_position_embeddings)
    limit = spec.max_position_embeddings if "dynamic" in rope_type else original
    if ("dynamic" in rope_type or rope_type == "longrope") and max_context > limit:
        raise EngineError(
            f"rope_type {rope_type!r} needs max_context <= {limit}, got {max_context}"
        )
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise EngineError(f"rope_type {rope_type!r} not supported")
    hf_config = AutoConfig.from_pretrained(str(path))
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


def load_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors, or of every shard named by model.safetensors.index.json."""
    state: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(Path(path)):
        if not file.exists():
            raise EngineError(f"no model.safetensors or model.safetensors.index.json in {path}")
        state.update(load_file(str(file)))
    return state


@dataclass
class Linear:
    """One fused projection: `weight` rows are the member modules' outputs, in order."""

    weight: torch.Tensor  # [sum of out_features, in_features]
    bias: torch.Tensor | None
    parts: tuple[tuple[str, int, int], ...]  # (module, first output column, end column)


@dataclass
class Layer:
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    # Qwen3's per-head norms of q and k ([head_dim]); None where the architecture has none, so
    # Llama/Qwen2 run no extra op
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None

    def group(self, name: str) -> Linear:
        return getattr(self, name)


# How a forward reaches the adapters: (layer index, group name, linear, input) -> output.
Project = Callable[[int, str, Linear, torch.Tensor], torch.Tensor]
HeadDelta = Callable[[torch.Tensor, torch.Tensor], None]  # (normed hidden, logits): adds in place
# How a forward attends: (layer index, q [n,H,T,D], k [n,Hkv,T,D], v) -> [n,H,T,D].
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def plain_linear(layer: int, group: str, lin: Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, lin.weight, lin.bias)


class Decoder:
    """Llama/Qwen2/Qwen3 forward over plain tensors. Not thread-safe; one engine owns it."""

    def __init__(
        self,
        path: str | Path,
        *,
        max_context: int | None = None,
        dtype: str = "float32",
        device: str = "cpu",
    ) -> None:
        if dtype not in DTYPES:
            raise EngineError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
        self.spec, raw = read_spec(path)
        problem = unsupported(self.spec, raw)
        if problem is not None:
            raise EngineError(f"{path}: {problem}")
        self.max_context = max_context or min(self.spec.max_position_embeddings, 4096)
        self.dtype = DTYPES[dtype]
        self.device = torch.device(device)
        inv_freq, self.attention_scaling = rope_frequencies(path, raw, self.spec, self.max_context)
        self._inv_freq = inv_freq
        self._build(load_checkpoint(path))
        # called twice a layer (after attention, after the MLP): the engine's heartbeat moves
        # through a long prefill: every second or two even in a 1.5B model's 4096-token prefill on
        # one CPU thread, well inside the pool's 5 s
        self.on_layer: Callable[[], None] = lambda: None

    # ---- weights -------------------------------------------------------------------------------

    def _build(self, state: dict[str, torch.Tensor]) -> None:
        """Fuse per-module HF tensors into the layer structs, on self.device in self.dtype."""
        s = self.spec

        def take(name: str) -> torch.Tensor:
            if name not in state:
                raise EngineError(f"checkpoint lacks tensor {name!r}")
            return state[name].to(device=self.device, dtype=self.dtype)

        def fuse(prefix: str, members: tuple[str, ...]) -> Linear:
            weights, biases, parts, start = [], [], [], 0
            for m in members:
                w = take(f"{prefix}.{m}.weight")
                b = state.get(f"{prefix}.{m}.bias")
                weights.append(w)
                biases.append(b)
                parts.append((m, start, start + w.shape[0]))
                start += w.shape[0]
            bias = None
            if any(b is not None for b in biases):  # a member without bias gets zeros, not exported
                bias = torch.cat(
                    [
                        (b if b is not None else torch.zeros(w.shape[0])).to(
                            self.device, self.dtype
                        )
                        for b, w in zip(biases, weights, strict=True)
                    ]
                )
                self._bias_members.update(
                    f"{prefix}.{m}" for m, b in zip(members, biases, strict=True) if b is not None
                )
            return Linear(torch.cat(weights).contiguous(), bias, tuple(parts))

        self._bias_members: set[str] = set()
        self.embed = take("model.embed_tokens.weight")
        self.final_norm = take("model.norm.weight")
        self.lm_head = self.embed if s.tie_embeddings else take("lm_head.weight")
        qk_norm = s.model_type in QK_NORM_MODEL_TYPES
        self.layers = []
        for i in range(s.num_layers):
            p = f"model.layers.{i}"
            self.layers.append(
                Layer(
                    attn_norm=take(f"{p}.input_layernorm.weight"),
                    mlp_norm=take(f"{p}.post_attention_layernorm.weight"),
                    **{g: fuse(p, members) for g, members in GROUPS.items()},
                    q_norm=take(f"{p}.self_attn.q_norm.weight") if qk_norm else None,
                    k_norm=take(f"{p}.self_attn.k_norm.weight") if qk_norm else None,
                )
            )
        freqs = torch.outer(torch.arange(self.max_context, dtype=torch.float), self._inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * self.attention_scaling).to(self.device, self.dtype)
        self.sin = (emb.sin() * self.attention_scaling).to(self.device, self.dtype)

    def params(self) -> dict[str, torch.Tensor]:
        """HF name -> tensor (views into the fused weights; writing one writes the model)."""
        out = {
            "model.embed_tokens.weight": self.embed,
            "model.norm.weight": self.final_norm,
            "lm_head.weight": self.lm_head,
        }  # tied: the same tensor as the embedding
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}"
            out[f"{p}.input_layernorm.weight"] = layer.attn_norm
            out[f"{p}.post_attention_layernorm.weight"] = layer.mlp_norm
            if layer.q_norm is not None and layer.k_norm is not None:
                out[f"{p}.self_attn.q_norm.weight"] = layer.q_norm
                out[f"{p}.self_attn.k_norm.weight"] = layer.k_norm
            for g in GROUPS:
                lin = layer.group(g)
                for m, a, b in lin.parts:
                    out[f"{p}.{m}.weight"] = lin.weight[a:b]
                    if f"{p}.{m}" in self._bias_members and lin.bias is not None:
                        out[f"{p}.{m}.bias"] = lin.bias[a:b]
        return out

    def to(self, device: str | torch.device) -> None:
        """Move all weights (release_memory/resume_memory on CUDA). Views are rebuilt."""
        state = {k: v.to(device) for k, v in self.params().items()}
        self.device = torch.device(device)
        self._build(state)

    # ---- forward -------------------------------------------------------------------------------

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op; same math as below when nothing is cast
            return F.rms_norm(x, weight.shape, weight, self.spec.rms_eps)
        # transformers' RMSNorm: statistics in float32, scale applied in the input dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.spec.rms_eps)
        return weight * xf.to(x.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def _qk_norm(self, qk: torch.Tensor, layer: Layer) -> torch.Tensor:
        """Qwen3: RMSNorm of each q and k head [n, T, H+Hkv, D] over head_dim, before rope.

        One norm over all heads, then a per-head weight (q_norm on the q heads, k_norm on the k
        heads): fewer ops than a norm each for q and k rejoined for the one rope call. The weight
        is expanded per call, from the tensors that params() exposes, so a push takes effect.
        """
        s = self.spec
        assert layer.q_norm is not None and layer.k_norm is not None  # a Qwen3 layer's
        weight = torch.cat(
            (layer.q_norm.expand(s.num_heads, -1), layer.k_norm.expand(s.num_kv_heads, -1))
        )
        # F.rms_norm wants a weight of the normalized shape: apply it after
        if qk.dtype == torch.float32:
            return F.rms_norm(qk, weight.shape[-1:], None, s.rms_eps) * weight
        # statistics per head in float32; the [H+Hkv, D] weight broadcasts
        return self._norm(qk, weight)

    def _layers(
        self, tokens: torch.Tensor, positions: torch.Tensor, attend: Attend, project: Project
    ) -> torch.Tensor:
        """Run all layers over tokens [n, T] at positions [n, T]; return hidden [n*T, hidden]."""
        s = self.spec
        n, t = tokens.shape
        h_q, h_kv, d = s.num_heads, s.num_kv_heads, s.head_dim
        cos = self.cos[positions].unsqueeze(2)  # [n, T, 1, D], shared by q and k heads
        sin = self.sin[positions].unsqueeze(2)
        h = F.embedding(tokens.reshape(-1), self.embed)
        for i, layer in enumerate(self.layers):
            x = self._norm(h, layer.attn_norm)
            qkv = project(i, "qkv", layer.qkv, x)
            # q and k are adjacent columns of the fused output: one rope call rotates both
            qk = qkv[:, : (h_q + h_kv) * d].view(n, t, h_q + h_kv, d)
            if layer.q_norm is not None:
                qk = self._qk_norm(qk, layer)
            qk = self._rope(qk, cos, sin)
            q = qk[:, :, :h_q].transpose(1, 2)
            k = qk[:, :, h_q:].transpose(1, 2)
            v = qkv[:, (h_q + h_kv) * d :].view(n, t, h_kv, d).transpose(1, 2)
            a = attend(i, q, k, v).transpose(1, 2).reshape(n * t, h_q * d)
            self.on_layer()
            h = h + project(i, "o", layer.o, a)
            x = self._norm(h, layer.mlp_norm)
            gate, up = project(i, "gate_up", layer.gate_up, x).chunk(2, dim=-1)
            h = h + project(i, "down", layer.down, F.silu(gate) * up)
            self.on_layer()
        return h

    def logits(self, h: torch.Tensor, delta: HeadDelta | None = None) -> torch.Tensor:
        """Final norm + lm_head, in float32 for the sampler; `delta` adds an adapter's share (a LoRA
        on the output projection) to the logits, from the normed hidden states."""
        x = self._norm(h, self.final_norm)
        logits = F.linear(x, self.lm_head)
        if delta is not None:
            delta(x, logits)
        return logits.float()

    def prefill(
        self,
        tokens: torch.Tensor,
        project: Project = plain_linear,
        store: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Causal forward over right-padded tokens [n, T] from position 0; returns hidden [n, T,
        hidden].

        Padding sits after each sequence's last token, so causal masking alone keeps it out of
        every real position. `store(layer, k, v)` receives each layer's keys/values [n, Hkv, T, D].
        """
        n, t = tokens.shape
        positions = torch.arange(t, device=self.device).expand(n, t)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if store is not None:
                store(i, k, v)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        return self._layers(tokens, positions, attend, project).view(n, t, -1)

    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        kv_len: int,
        project: Project = plain_linear,
    ) -> torch.Tensor:
        """One token per row: tokens/positions [n]; row r uses cache row r. Returns hidden [n,
        hidden].

        The new key/value is written at `positions[r]`, then each row attends over its first
        positions[r]+1 cache entries (`kv_len` = the longest of them).
        """
        n = tokens.shape[0]
        s = self.spec
        rows = torch.arange(n, device=self.device)
        mask = (torch.arange(kv_len, device=self.device) <= positions[:, None]).view(
            n, 1, 1, kv_len
        )
        groups = s.num_heads // s.num_kv_heads

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kc, vc = k_cache[i], v_cache[i]
            kc[rows, :, positions] = k[:, :, 0]
            vc[rows, :, positions] = v[:, :, 0]
            # one query per row: the G query heads of a kv head become G query positions, so no
            # repeat of the cache is needed
            qg = q.reshape(n, s.num_kv_heads, groups, s.head_dim)
            out = F.scaled_dot_product_attention(
                qg, kc[:n, :, :kv_len], vc[:n, :, :kv_len], attn_mask=mask
            )
            return out.reshape(n, s.num_heads, 1, s.head_dim)

        return self._layers(tokens.view(n, 1), positions.view(n, 1), attend, project)


def validate_weights(decoder: Decoder, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Check a full-weight push against the model; return name -> destination view. Changes
    nothing."""
    params = decoder.params()
    if not tensors:
        raise EngineError("update_weights: no tensors given")
    for name, t in tensors.items():
        if name not in params:
            raise EngineError(f"update_weights: unknown parameter name {name!r}")
        check_tensor(f"update_weights: {name}", t, tuple(params[name].shape))
    return params
