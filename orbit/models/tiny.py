"""Build a tiny Llama-, Qwen2- or Qwen3-architecture model offline: random init, local tokenizer.

The result is an ordinary Hugging Face checkpoint (config.json, model.safetensors, tokenizer
files) that `AutoModelForCausalLM` / `AutoTokenizer` load. Nothing is fetched from a hub.
Deterministic on one machine: the same arch and seed give the same bytes (torch's random normals
round differently on another instruction set, orbit/host/floats.py).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

ARCHS = ("llama", "qwen2", "qwen3")
# Shapes: "tiny" for tests and the demo; "small" (~3M parameters) for the bench, where a step must
# cost enough that generation and training, not Python overhead, dominate.
SIZES = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "small": dict(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
    ),
}
# Qwen3's head_dim is explicit (Qwen3-0.6B: 128 with hidden 1024 / 16 heads) and Qwen3Config's
# default is 128 whatever the size. The tiny one differs from hidden / heads (64 / 4 = 16), as in
# the real models, so the tests exercise that; the small one keeps the other archs' shapes.
QWEN3_HEAD_DIM = {"tiny": 32, "small": 32}
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>"]
# Markup of the built-in tasks (orbit/tasks), one token each in a task model's tokenizer.
TASK_TOKENS = ["<answer>", "</answer>", "LOOKUP(", ")"]
VOCAB_SIZE = 384  # BPE vocabulary (special tokens included); task tokens come on top

_WORDS = (
    "the a an of to and in is it that for on with as was at by be this from or have not are but "
    "one two three four five six seven eight nine ten red blue green cat dog sun moon star tree "
    "orbit model train step reward answer question yes no say repeat number plus minus times "
    "equals count list word letter pattern hello world good bad fast slow up down left right"
).split()


def _corpus(seed: int) -> list[str]:
    """Synthetic text: words, digits and arithmetic, enough for a small byte-level BPE."""
    rng = random.Random(seed)
    lines = []
    for _ in range(3000):
        kind = rng.random()
        if kind < 0.5:
            lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12))))
        elif kind < 0.8:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            op = rng.choice("+-*")
            lines.append(f"{a} {op} {b} = {eval(f'{a}{op}{b}')}")
        else:
            lines.append(
                " ".join(
                    rng.choice("abcdefghijklmnopqrstuvwxyz") * rng.randint(1, 4)
                    for _ in range(rng.randint(2, 8))
                )
            )
    return lines


def _task_corpus(seed: int) -> list[str]:
    """Text in the shape of the built-in tasks' prompts and answers (orbit/tasks)."""
    rng = random.Random(seed + 1)
    letters = "abcdefghijklmnopqrstuvwxyz"
    lines = []
    for _ in range(1500):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        lines.append(f"{a}+{b}=<answer>{a + b}</answer>")
        k, v = rng.choice(letters), rng.choice(letters)
        lines.append(f"zorplex({k})?LOOKUP({k})={v};LOOKUP({v})={rng.randint(10, 99)};")
    return lines


def build_tokenizer(seed: int = 0, task_tokens: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on a synthetic corpus.

    `task_tokens`: the tokenizer of a task model (`orbit model tiny --task`): one token per digit,
    so numbers are written digit by digit (which a tiny model can learn to add), and the tasks'
    markup (TASK_TOKENS) as single tokens, so an answer tag or a tool call is one step and a tool
    call's end can stop a turn. Without it, the plain tokenizer of the demo and the bench.
    """
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    corpus = _corpus(seed)
    if task_tokens:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
        corpus += _task_corpus(seed)
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    if task_tokens:
        tok.add_tokens([AddedToken(t, normalized=False) for t in TASK_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>"
    )


def tiny_config(arch: str, vocab_size: int, tok: PreTrainedTokenizerFast, size: str = "tiny"):
    common = dict(
        vocab_size=vocab_size,
        **SIZES[size],  # both sizes use grouped-query attention
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        dtype="float32",
    )
    if arch == "llama":
        return LlamaConfig(
            **common, rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False
        )
    if arch == "qwen2":
        return Qwen2Config(**common, rope_theta=1000000.0, tie_word_embeddings=True)
    if arch == "qwen3":  # tied, as Qwen3-0.6B; no q/k/v bias (attention_bias=False), q/k norms
        return Qwen3Config(
            **common,
            head_dim=QWEN3_HEAD_DIM[size],
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            attention_bias=False,
        )
    raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")


def build_tiny_model(
    out: str | Path,
    arch: str = "llama",
    seed: int = 0,
    size: str = "tiny",
    task_tokens: bool = False,
) -> Path:
    """Write a tiny random-init checkpoint with its tokenizer to `out` and return the path.

    `task_tokens`: use the task tokenizer (see `build_tokenizer`); `orbit.models.warmstart` builds
    on it.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {tuple(SIZES)}, got {size!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(seed, task_tokens=task_tokens)
    config = tiny_config(arch, len(tok), tok, size)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # a little larger than the default init, so the random model has opinions
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08 * (64 / config.hidden_size) ** 0.5)
            elif "bias" in name:
                p.normal_(0.0, 0.02)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):  # Qwen3
                # not all ones: uniform weights commute with rope (a rotation keeps the RMS) and
                # make q's and k's norms interchangeable, so tests could not see their order or
                # names
                p.normal_(1.0, 0.2)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out
