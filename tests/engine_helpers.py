"""Reference models for the embedded-engine tests: transformers, transformers + peft."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, OFTConfig, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM

from orbit.engine.embedded import EngineCore, EngineOptions

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def engine_core(path, **options) -> EngineCore:
    """The embedded engine in-process (the unit under test without its process wrapper)."""
    return EngineCore(str(path), EngineOptions(**options))


def hf_model(path: Path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def peft_adapter(path: Path, kind: str = "lora", seed: int = 0, **options):
    """A peft model with non-trivial random adapter weights (peft's init is the identity).

    Returns (peft model, adapter tensors exactly as get_peft_model_state_dict gives them,
    peft_config.to_dict()).
    """
    if kind == "lora":
        config = LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": TARGETS, **options})
    elif kind == "oft":
        config = OFTConfig(**{"r": 0, "oft_block_size": 16, "target_modules": TARGETS, **options})
    else:
        raise ValueError(kind)
    model = get_peft_model(hf_model(path), config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif "lora_B" in name or "oft_R" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    tensors = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    return model, tensors, model.peft_config["default"].to_dict()


@torch.no_grad()
def hf_logprobs(model, prompt: list[int], continuation: list[int]) -> list[float]:
    """Teacher-forced log_softmax of each continuation token."""
    ids = torch.tensor([prompt + continuation])
    logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(continuation) - 1)
    return logp[pos, torch.tensor(continuation)].tolist()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos: int) -> list[int]:
    """transformers' greedy generate, cut after the first eos (it pads the rest)."""
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                         pad_token_id=0)[0, len(prompt):].tolist()
    return out[: out.index(eos) + 1] if eos in out else out


def prompts(n: int, seed: int = 0, low: int = 3, high: int = 14) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (n,), generator=gen).tolist()
    return [torch.randint(3, 384, (k,), generator=gen).tolist() for k in lengths]


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b, strict=True))
