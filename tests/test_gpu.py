"""On a CUDA GPU, as users run Orbit there: engine and trainer in bf16 on the GPU (issue 15).

Every test here is marked `gpu`. `make test` (pyproject's `-m "not gpu"`) deselects them; `make
test-gpu` runs them (`pytest -m gpu`), and by hand: `pytest -m gpu tests/test_gpu.py`. Where torch
sees no CUDA device they skip. The SGLang ones are marked `sglang` too (tests/sglang_gate.py: they
skip without sglang 0.5.23, and fail instead in CI, where `make test-gpu` has installed it).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from engine_helpers import prompts
from run_helpers import patched, run_metrics

from orbit.config import AdapterConfig, TrainerConfig, parse_recipe
from orbit.config.modes import MODE_NAMES
from orbit.engine.base import SamplingParams
from orbit.rollout.sample import Sample
from orbit.run.preflight import preflight

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU (torch.cuda.is_available() is False)"
    ),
]

ROOT = Path(__file__).resolve().parent.parent
# Mean |engine - trainer| logprob of the same tokens, bf16 on the GPU. bf16 keeps 8 significant
# bits: every weight and activation is rounded by up to 2^-9 (0.2%), and through the layers that
# moves a token's logprob by a few 1e-3 on average (the tail reaches a few 1e-2). Measured on CPU
# with this file's model and adapter (bf16 engine; trainer fp32 or bf16): mean 2.5e-3 to 5.4e-3,
# max 2.8e-2. The bound gives 4x room for CUDA's kernels; a real mismatch (no adapter, a wrong one,
# a wrong scale) is far above it: this adapter alone moves the logprobs by ~0.37 on average.
BF16_MEAN_TOL = 2e-2
LORA_INIT = 0.05  # std of the random LoRA A and B (peft's B starts at zero: no effect to compare)
STEPS = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A small random Llama (2 layers, hidden 256) with head_dim 64: the tiny model's 16 is not a
    size every CUDA attention kernel takes (FlashInfer's, SGLang's default on many GPUs, is built
    for 64, 128 and 256). Same tokenizer and init as `orbit model tiny`."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from orbit.models.tiny import build_tokenizer

    out = tmp_path_factory.mktemp("llama-h64")
    tok = build_tokenizer(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        dtype="float32",
    )
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08 * (64 / config.hidden_size) ** 0.5)
    hf.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _trainer(model: Path, dtype: str):
    """Orbit's trainer on the GPU with random non-zero LoRA A and B (the recipe's default
    adapter)."""
    from orbit.train.trainer import Trainer

    trainer = Trainer(
        model, AdapterConfig(), TrainerConfig(device="cuda", dtype=dtype), temperature=1.0, seed=1
    )
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * LORA_INIT)
    return trainer


def _agreement(engine, trainer) -> tuple[float, float, float]:
    """The trainer's adapter in slot 0; 16 sampled completions (T = 1). Returns mean and max |engine
    - trainer| logprob of the sampled tokens, and the mean effect of the adapter on them."""
    engine.load_adapter(0, trainer.adapter_tensors(), trainer.adapter_config(), version=1)
    futures = [
        engine.generate(p, SamplingParams(max_new_tokens=32, temperature=1.0, seed=i), slot=0)
        for i, p in enumerate(prompts(16, seed=4))
    ]
    done = [f.result(300) for f in futures]
    samples = [Sample(c.prompt_ids, c.output_ids, c.logprobs, 0.0, 1, 1) for c in done]
    diffs = [
        abs(a - b)
        for c, ref in zip(done, trainer.logprobs(samples), strict=True)
        for a, b in zip(c.logprobs, ref, strict=True)
    ]
    # the same tokens under the base model: what the adapter changes
    with trainer.model.disable_adapter():
        base = trainer.logprobs(samples)
    effect = [
        abs(a - b)
        for c, ref in zip(done, base, strict=True)
        for a, b in zip(c.logprobs, ref, strict=True)
    ]
    assert diffs, "no tokens generated"
    return sum(diffs) / len(diffs), max(diffs), sum(effect) / len(effect)


def _check_agreement(engine, trainer, what: str, capsys) -> None:
    mean, worst, effect = _agreement(engine, trainer)
    with capsys.disabled():
        print(
            f"\n{what}: mean |engine - trainer| logprob {mean:.2e} (max {worst:.2e}); adapter "
            f"effect {effect:.2f}"
        )
    assert effect > 5 * BF16_MEAN_TOL, (
        "the adapter must move the logprobs, else the comparison proves nothing"
    )
    assert mean < BF16_MEAN_TOL


def _recipe(model: Path, out: Path, mode: str, **patch) -> dict:
    data = {
        "model": str(model),
        "adapter": {"type": "lora", "r": 8, "alpha": 16},
        # backend named: `auto` would pick SGLang on a GPU where it is installed
        "engine": {
            "backend": "embedded",
            "max_inflight": 16,
            "max_running": 16,
            "device": "cuda",
            "dtype": "bfloat16",
        },
        "rollout": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 12},
        "trainer": {
            "lr": 0.01,
            "steps": STEPS,
            "save_every": 2,
            "device": "cuda",
            "dtype": "bfloat16",
        },
        "mode": mode,
        "max_staleness": 2,
        "out": str(out),
        "seed": 1,
    }
    return patched(data, patch)


def _check_run(run_dir: Path) -> None:
    rows = run_metrics(run_dir)
    assert [r["version"] for r in rows] == list(range(1, STEPS + 1))
    diffs = [r["logprob_diff"] for r in rows if r["logprob_diff"] is not None]
    assert diffs and max(diffs) < BF16_MEAN_TOL, diffs
    assert (run_dir / "adapter" / "adapter_model.safetensors").exists()


# ---- the embedded engine -------------------------------------------------------------------------


@pytest.mark.parametrize("trainer_dtype", ["float32", "bfloat16"])
def test_embedded_engine_matches_the_trainer_in_bf16(model, trainer_dtype, capsys):
    from orbit.engine.embedded import start_embedded_engine

    trainer = _trainer(model, trainer_dtype)
    engine = start_embedded_engine(model, max_running=16, dtype="bfloat16", device="cuda")
    try:
        _check_agreement(
            engine, trainer, f"embedded bf16 vs trainer {trainer_dtype} (cuda)", capsys
        )
    finally:
        engine.shutdown()


@pytest.mark.parametrize("mode", MODE_NAMES)
def test_each_mode_on_the_gpu(model, tmp_path, mode):
    from orbit.run.lifecycle import train

    result = train(preflight(parse_recipe(_recipe(model, tmp_path / mode, mode))), live=False)
    assert result.steps_done == STEPS
    _check_run(tmp_path / mode)


def test_embedded_engine_tokens_per_second_against_generate(model, capsys):
    """Printed, not asserted: bench/engine_throughput.py's workload on the GPU, both sides in
    bf16."""
    from transformers import AutoModelForCausalLM

    from orbit.engine.embedded import start_embedded_engine

    spec = importlib.util.spec_from_file_location(
        "engine_throughput", ROOT / "bench" / "engine_throughput.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    ps, lengths = bench.workload(64, seed=0)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).to("cuda").eval()
    hf.generation_config.eos_token_id = None  # ignore_eos, as the engine requests do
    engine = start_embedded_engine(model, max_running=32, dtype="bfloat16", device="cuda")
    try:
        bench.run_engine(engine, ps[:8], [16] * 8)  # warm-up both
        bench.run_transformers(hf, ps[:8], [16] * 8, 8)
        eng_tok, eng_s = bench.run_engine(engine, ps, lengths)
        hf_tok, hf_s = bench.run_transformers(hf, ps, lengths, 32)
    finally:
        engine.shutdown()
    with capsys.disabled():
        print(
            f"\n{torch.cuda.get_device_name()}, bf16, {len(ps)} requests, {sum(lengths)} useful "
            f"tokens: embedded {eng_tok / eng_s:,.0f} tok/s, transformers generate "
            f"{hf_tok / hf_s:,.0f} tok/s ({(eng_tok / eng_s) / (hf_tok / hf_s):.2f}x)"
        )
    assert eng_tok == hf_tok == sum(lengths)


# ---- SGLang --------------------------------------------------------------------------------------

# of the GPU's memory for SGLang's weights and KV pool; the trainer shares the GPU
SGLANG_MEM_FRACTION = 0.3


@pytest.mark.sglang
@pytest.mark.timeout(600)
def test_sglang_matches_the_trainer_in_bf16(model, capsys):
    from orbit.engine.sglang import ALL_TARGETS, start_sglang_engine

    trainer = _trainer(model, "bfloat16")
    engine = start_sglang_engine(
        model,
        device="cuda",
        dtype="bfloat16",
        max_running=16,
        max_lora_rank=8,
        lora_target_modules=ALL_TARGETS,
        mem_fraction=SGLANG_MEM_FRACTION,
    )
    try:
        _check_agreement(engine, trainer, "SGLang bf16 vs trainer bf16 (cuda)", capsys)
    finally:
        engine.shutdown()


@pytest.mark.sglang
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", MODE_NAMES)
def test_each_mode_on_sglang_on_the_gpu(model, tmp_path, mode):
    from orbit.run.lifecycle import train

    recipe = _recipe(
        model,
        tmp_path / mode,
        mode,
        engine={"backend": "sglang", "mem_fraction": SGLANG_MEM_FRACTION},
    )
    result = train(preflight(parse_recipe(recipe)), live=False)
    assert result.steps_done == STEPS
    _check_run(tmp_path / mode)


# ---- orbit serve's trainer --------------------------------------------------------------------


def test_service_clients_train_on_the_gpu_as_on_the_cpu(model, tmp_path):
    """`orbit serve`'s trainer on trainer.device: several clients' packed forward_backward and their
    optimizer steps on CUDA give the CPU's logprobs, losses and adapters (fp32; CUDA's kernels sum
    in other orders, hence 1e-4), the adapter goes to the engines from the CPU, and a saved state
    loads back on the GPU where it left off (its optimizer's too)."""
    from test_packing import CLIENTS, _data

    from orbit.serve.clients import AdamParams, Request, TrainingClient, forward_backward
    from orbit.train.shared import SharedBase

    seen = {}
    for device in ("cpu", "cuda"):
        base = SharedBase(model, "float32", device)
        clients = [
            TrainingClient("m", f"c{i}", base, spec) for i, (spec, _, _) in enumerate(CLIENTS)
        ]
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():  # B = 0 (peft's init) would hide a wrong A gradient
            for c in clients:
                for p in c.params:
                    assert p.device.type == device
                    p.copy_(torch.randn(p.shape, generator=gen) * LORA_INIT)
        data = [_data(i, loss_fn) for i, (_, loss_fn, _) in enumerate(CLIENTS)]
        requests = [
            Request(c, d, loss_fn, {}, False)
            for c, d, (_, loss_fn, _) in zip(clients, data, CLIENTS, strict=True)
        ]
        scored = forward_backward(base, requests, packed=True)
        for c, (_, _, lr) in zip(clients, CLIENTS, strict=True):
            c.optim_step(AdamParams(learning_rate=lr))
        adapters = [c.adapter()[0] for c in clients]
        assert all(t.device.type == "cpu" for a in adapters for t in a.values())
        seen[device] = (scored, adapters)
    # the last client's state, saved from the GPU and loaded into a fresh client there
    saved = tmp_path / "state"
    clients[-1].save(saved, optimizer=True)
    again = TrainingClient("m", "again", base, CLIENTS[-1][0])
    again.load(saved, optimizer=True)
    assert again.steps == 1 and all(p.device.type == "cuda" for p in again.params)
    mine, theirs = again.adapter()[0], adapters[-1]  # peft's names without the adapter's
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    state = again.optimizer.state_dict()["state"]
    assert state and all(
        t.device.type == "cuda" for s in state.values() for t in s.values() if torch.is_tensor(t)
    )
    for cpu, gpu in zip(*(seen[d][0] for d in ("cpu", "cuda")), strict=True):
        assert abs(cpu.loss - gpu.loss) <= 1e-4 * max(abs(cpu.loss), 1.0)
        for a, b in zip(cpu.logprobs, gpu.logprobs, strict=True):
            assert float((a - b).abs().max()) <= 1e-4 * max(float(a.abs().max()), 1.0)
    # to 1e-4 of the adapter's norm: Adam's step divides by each coordinate's gradient, so where
    # one is near 0 a rounding difference becomes a visible one (tests/test_packing.py)
    for a, b in zip(*(seen[d][1] for d in ("cpu", "cuda")), strict=True):
        diff = torch.cat([(a[k] - b[k]).flatten() for k in a]).norm()
        assert float(diff) <= 1e-4 * float(torch.cat([a[k].flatten() for k in a]).norm())
