"""Reference models for the engine tests (transformers, transformers + peft), teacher-forced scores
on the embedded engine, and a minimal engine double for unit tests of one piece."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import torch
from peft import LoraConfig, OFTConfig, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM

from orbit.engine.base import Capabilities, EngineInfo, EngineStats
from orbit.engine.embedded import EngineCore, EngineOptions
from orbit.engine.embedded.model import plain_linear
from orbit.engine.embedded.slots import SlotBatch

# logits two correct implementations may disagree by (measured ~1e-6 here in fp32), so a token
# this close to the argmax is a tie
GREEDY_TIE = 1e-4
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
def check_greedy(model, prompt: list[int], output: list[int], max_new: int, eos: int) -> None:
    """`output` is greedy decoding of `model` after `prompt`: each token the argmax of the model's
    logits given the tokens before it, ending at the first eos or after `max_new`. Within
    GREEDY_TIE of the largest logit: two implementations put a near-tie apart by their last bits,
    and which one wins then is the machine's (its instruction set), not the engine's."""
    assert output and len(output) <= max_new
    assert eos not in output[:-1] and (output[-1] == eos or len(output) == max_new)
    start = len(prompt) - 1
    logits = model(torch.tensor([prompt + output])).logits[0, start : start + len(output)].float()
    chosen = logits[torch.arange(len(output)), torch.tensor(output)]
    behind = (logits.max(dim=-1).values - chosen).max().item()
    assert behind <= GREEDY_TIE, f"a token {behind:.2g} below the model's argmax: not greedy"


def prompts(n: int, seed: int = 0, low: int = 3, high: int = 14) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (n,), generator=gen).tolist()
    return [torch.randint(3, 384, (k,), generator=gen).tolist() for k in lengths]


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@torch.no_grad()
def score(
    core: EngineCore, prompt: list[int], continuation: list[int], slot: int | None = None
) -> list[float]:
    """Teacher-forced logprobs (temperature 1) of each continuation token after the prompt, through
    the embedded engine's own decoder and the slot's adapter."""
    return score_batch(core, [(prompt, continuation, slot)])[0]


@torch.no_grad()
def score_batch(
    core: EngineCore, items: list[tuple[list[int], list[int], int | None]]
) -> list[list[float]]:
    """`score` of several (prompt, continuation, slot) in one padded forward of the decoder; rows on
    different slots each get their own slot's adapter."""
    width = max(len(p) + len(c) for p, c, _ in items)
    tokens = torch.zeros(len(items), width, dtype=torch.long)
    for i, (p, c, _) in enumerate(items):
        tokens[i, : len(p) + len(c)] = torch.tensor(p + c)
    slots = sorted({s for _, _, s in items if s is not None})
    entries = []
    for s in slots:
        rows = [i for i, (_, _, x) in enumerate(items) if x == s]
        idx = (torch.tensor(rows)[:, None] * width + torch.arange(width)).reshape(-1)
        entries.append((core.slots[s], idx))
    project = SlotBatch(entries).project if entries else plain_linear
    with torch.inference_mode():
        hidden = core.decoder.prefill(tokens.to(core.decoder.device), project)
        out = []
        for i, (p, c, _) in enumerate(items):
            logp = torch.log_softmax(
                core.decoder.logits(hidden[i, len(p) - 1 : len(p) + len(c) - 1]), dim=-1
            )
            out.append(
                logp.gather(1, torch.tensor(c, device=logp.device)[:, None]).squeeze(1).tolist()
            )
    return out


class FakeEngine:
    """A test double of the engine protocol for a unit test of one piece (the pool, the pipeline,
    the push): it answers what the piece asks and records the calls. Never proof that the system
    works."""

    adapter_transport = "shared-memory"

    def __init__(self, slots: int = 2, pid: int = 0, max_context: int = 4096) -> None:
        self.info = EngineInfo(
            pid=pid,
            model_type="llama",
            vocab_size=100,
            max_context=max_context,
            eos_token_ids=(2,),
            num_layers=1,
            device="cpu",
            dtype="float32",
        )
        self.capabilities = Capabilities(
            slots=slots, oft_slots=True, loads_while_paused=True, flush_while_running=True
        )
        self.calls: list[tuple] = []
        self.slot_requests = tuple([0] * slots)
        self.active_slot: int | None = None  # what stats() reports; a test sets it

    def generate(self, prompt_ids, sampling, slot="active", meta=None) -> Future:
        self.calls.append(("generate", slot))
        return Future()

    def load_adapter(self, slot, tensors, adapter_config, version) -> float:
        self.calls.append(("load_adapter", slot, version))
        return 0.0

    def activate(self, slot) -> None:
        self.calls.append(("activate", slot))

    def pause_generation(self, mode="in_place") -> None:
        self.calls.append(("pause_generation", mode))

    def flush_cache(self) -> None:
        self.calls.append(("flush_cache",))

    def continue_generation(self) -> None:
        self.calls.append(("continue_generation",))

    def update_weights(self, tensors, version) -> None:
        self.calls.append(("update_weights", version))

    def release_memory(self) -> None:
        self.calls.append(("release_memory",))

    def resume_memory(self) -> None:
        self.calls.append(("resume_memory",))

    def stats(self) -> EngineStats:
        return EngineStats(slot_requests=self.slot_requests, active_slot=self.active_slot)

    def heartbeat(self) -> int | None:
        return None

    def lend_threads(self, n: int) -> None:
        self.calls.append(("lend_threads", n))

    def shutdown(self) -> None:
        self.calls.append(("shutdown",))

    def kill(self) -> None:
        self.calls.append(("kill",))
