"""A checkpoint's shape facts, read once from its config.json: what every engine backend, the
recipe's checks and the memory plan need to know about a Llama/Qwen-family model.

`read_spec` is the one reader of config.json in Orbit. It follows the model config classes of
transformers where config.json leaves a field out (head_dim: Qwen3's default is 128, not
hidden_size / heads; num_key_value_heads: the head count).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The output projection: a LoRA on it (Tinker's train_unembed) is keyed (HEAD_LAYER, HEAD)
HEAD, HEAD_LAYER = "lm_head", -1
# The projections an adapter may target, by their names inside a decoder layer.
MODULES: tuple[str, ...] = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
# head_dim when config.json has none: the config class's default, as transformers builds the model.
_DEFAULT_HEAD_DIM = {"qwen3": 128}


class SpecError(ValueError):
    """A config.json that cannot be read as a decoder's shape (missing field, not JSON)."""


@dataclass(frozen=True)
class ModelSpec:
    """The shape facts of a checkpoint."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    tie_embeddings: bool
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int

    def module_shape(self, module: str) -> tuple[int, int]:
        """(out_features, in_features) of a projection, e.g. 'self_attn.k_proj'."""
        q, kv, h, i = (
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.hidden_size,
            self.intermediate_size,
        )
        return {
            "self_attn.q_proj": (q, h),
            "self_attn.k_proj": (kv, h),
            "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, q),
            "mlp.gate_proj": (i, h),
            "mlp.up_proj": (i, h),
            "mlp.down_proj": (h, i),
            HEAD: (self.vocab_size, h),
        }[module]

    def in_features(self, target: str) -> int:
        """Input width of an adapter target named as in a recipe ('q_proj', 'down_proj', ...)."""
        module = next(m for m in MODULES if m.endswith("." + target))
        return self.module_shape(module)[1]


def read_config(path: str | Path) -> dict:
    """config.json of a checkpoint directory as a dict (SpecError when it is not a JSON object)."""
    file = Path(path) / "config.json"
    try:
        raw = json.loads(file.read_text())
    except ValueError:
        raise SpecError(f"{file} is not valid JSON") from None
    if not isinstance(raw, dict):
        raise SpecError(f"{file} is not a JSON object")
    return raw


def read_spec(path: str | Path) -> tuple[ModelSpec, dict]:
    """(the spec, config.json as a dict) of a checkpoint directory."""
    path = Path(path)
    raw = read_config(path)
    try:
        heads = raw["num_attention_heads"]
        spec = ModelSpec(
            model_type=str(raw.get("model_type")),
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim")
            or _DEFAULT_HEAD_DIM.get(raw.get("model_type", ""))
            or raw["hidden_size"] // heads,
            rms_eps=raw.get("rms_norm_eps", 1e-6),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids(path, raw),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
        )
    except KeyError as err:
        raise SpecError(f"{path / 'config.json'} lacks {err.args[0]!r}") from None
    return spec, raw


def eos_ids(path: Path, raw: dict) -> tuple[int, ...]:
    """eos from config.json and generation_config.json (transformers' generate uses the latter)."""
    ids: set[int] = set()
    sources = [raw]
    gen = path / "generation_config.json"
    if gen.exists():
        sources.append(json.loads(gen.read_text()))
    for src in sources:
        eos = src.get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(e) for e in eos)
    return tuple(sorted(ids))


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards its index names, or model.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        return [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [path / "model.safetensors"]


def checkpoint_file_of(path: Path, tensor: str) -> Path:
    """The safetensors file of a checkpoint that holds `tensor`."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        return path / json.loads(index.read_text())["weight_map"][tensor]
    return path / "model.safetensors"


def checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor of a checkpoint (safetensors headers only, nothing loaded)."""
    from safetensors import safe_open

    shapes = {}
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes
