"""`engine.backend: sglang-server` on real SGLang servers (CPU, tiny models, 127.0.0.1 only): servers
Orbit starts, a server the test starts and Orbit attaches to, the directory transport, the start-up
checks, a server killed mid-run. Every test stops exactly the processes it started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from run_helpers import check_no_request_ran_on_a_slot_being_written, checked, recipe_dict, run_metrics, run_timeline

from orbit.config import AdapterConfig, RecipeError, TrainerConfig
from orbit.engine.base import EngineError, SamplingParams
from orbit.engine.sglang.server import free_port
from orbit.engine.sglang_cpu import ENV_FLAG, SHIM_DIR
from orbit.run import train

pytestmark = [pytest.mark.sglang, pytest.mark.slow]  # skips without sglang, fails in CI (tests/sglang_gate.py)

KEY = "orbit-test-key-3f9c"
KEY_ENV = "ORBIT_TEST_SGLANG_KEY"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _start_server(model: Path, lora: bool, api_key: str | None = None) -> tuple[str, subprocess.Popen]:
    """What a user runs by hand (README, "SGLang servers"): python -m sglang.launch_server ..."""
    port = free_port()
    args = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend",
            "pytorch", "--disable-cuda-graph", "--mem-fraction-static", "0.05", "--max-total-tokens", "8192",
            "--context-length", "512", "--skip-tokenizer-init", "--dtype", "float32", "--max-running-requests", "16",
            "--sampling-mask-max-tokens", "512", "--log-level", "error"]
    if lora:
        args += ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", *TARGETS, "--max-loras-per-batch",
                 "4", "--lora-backend", "torch_native"]
    if api_key:
        args += ["--api-key", api_key]
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", ENV_FLAG: "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(SHIM_DIR)}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while True:
        assert proc.poll() is None, "the test's server exited while starting"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return url, proc
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the test's server did not start"
        time.sleep(0.5)


def _stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)  # its own process group: the server and its children, nothing else
    proc.wait(30)


@pytest.fixture(scope="module")
def served(tiny_llama):
    """A LoRA server with an API key, started by the test (the user's own, for attach mode)."""
    url, proc = _start_server(tiny_llama, lora=True, api_key=KEY)
    yield url, proc
    _stop(proc)


@pytest.fixture(scope="module")
def plain_qwen2(tiny_qwen2):
    """A server of another model, without LoRA."""
    url, proc = _start_server(tiny_qwen2, lora=False)
    yield url
    _stop(proc)


def _recipe(model: Path, out: Path, **patch) -> dict:
    return recipe_dict(model, out, {
        "adapter": {"type": "lora", "r": 8, "alpha": 16, "target_modules": TARGETS},
        "engine": {"backend": "sglang-server", "max_inflight": 8, "max_running": 8, "slots": 3},
        "mode": "double-buffer", "max_staleness": 1}, **patch)


def _check(run_dir: Path, steps: int) -> list[dict]:
    rows = run_metrics(run_dir)
    assert len(rows) == steps
    assert all(r["logprob_diff"] is None or r["logprob_diff"] < 1e-3 for r in rows)  # the in-process bound
    assert any(r["logprob_diff"] is not None for r in rows)
    check_no_request_ran_on_a_slot_being_written(run_timeline(run_dir))
    return rows


# ---- attach mode -----------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_attach_trains_and_leaves_the_server_running(tmp_path, tiny_llama, served, monkeypatch):
    url, proc = served
    monkeypatch.setenv(KEY_ENV, KEY)
    run_dir = tmp_path / "run"
    recipe = checked(_recipe(tiny_llama, run_dir, engine={"servers": [url], "api_key_env": KEY_ENV},
                                  rollout={"top_p": 0.9}))
    train(recipe, live=False)
    rows = _check(run_dir, 3)
    assert rows[0]["adapter_transport"] == ["local"]  # same host: Orbit's own adapter files in /dev/shm
    assert proc.poll() is None and httpx.get(f"{url}/health", timeout=5).status_code == 200  # left running
    for f in run_dir.rglob("*"):  # the key is never written down
        assert not f.is_file() or KEY.encode() not in f.read_bytes(), f


@pytest.mark.timeout(300)
def test_start_up_checks_fail_before_training_with_the_fix(tmp_path, tiny_llama, tiny_qwen2, served, plain_qwen2,
                                                           monkeypatch):
    url, _ = served
    monkeypatch.setenv(KEY_ENV, "not-the-key")
    cases = [
        (_recipe(tiny_llama, tmp_path / "a", engine={"servers": [url], "api_key_env": KEY_ENV}),
         f"engine.servers: {url}: the server refused the key in ${KEY_ENV} (HTTP 401)"),
        (_recipe(tiny_qwen2, tmp_path / "b", engine={"servers": [plain_qwen2]}),
         f"engine.servers: {plain_qwen2}: LoRA is off on the server; start it with --enable-lora"),
        (_recipe(tiny_llama, tmp_path / "c", engine={"servers": [plain_qwen2]}),
         f"engine.servers: {plain_qwen2}: the server serves a 'qwen2' model ['Qwen2ForCausalLM']; the recipe's is "
         "'llama'"),
    ]
    for data, message in cases:
        with pytest.raises(RecipeError) as err:
            train(checked(data), live=False)
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
        assert not Path(data["out"]).exists()  # nothing trained, nothing left
    # the same on the command line: one line, exit 2
    recipe = tmp_path / "r.yaml"
    recipe.write_text(json.dumps(cases[2][0]))
    res = subprocess.run([sys.executable, "-m", "orbit.cli", "train", str(recipe), "--quiet"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and "--model-path" in " ".join(res.stderr.split()) and "Traceback" not in res.stderr


@pytest.mark.timeout(300)
def test_the_directory_transport_writes_peft_that_peft_loads(tmp_path, tiny_llama, served):
    """Adapters for other hosts go through engine.adapter_dir in peft's format; what the server loaded
    is what peft computes; versions no slot uses any more are deleted."""
    from peft import PeftModel

    from orbit.engine.sglang.process import SGLangOptions
    from orbit.engine.sglang.server import start_server_engine
    from orbit.train.trainer import Trainer

    url, _ = served
    opts = SGLangOptions(max_running=8, slots=2, max_lora_rank=8, lora_target_modules=tuple(TARGETS))
    engine = start_server_engine(tiny_llama, opts, url=url, api_key=KEY, adapter_dir=tmp_path / "adapters",
                                 adapter_transport="dir", timeout_s=60)
    try:
        trainer = Trainer(tiny_llama, AdapterConfig(r=8, alpha=16, target_modules=TARGETS), TrainerConfig(), 1.0, 0)
        with torch.no_grad():
            for name, p in trainer.model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.2)
        for slot, version in ((0, 1), (1, 2), (0, 3)):
            engine.load_adapter(slot, trainer.adapter_tensors(), trainer.adapter_config(), version)
        written = sorted(p.name for p in (tmp_path / "adapters").rglob("orbit-slot-*"))
        assert written == ["orbit-slot-0-v3", "orbit-slot-1-v2"]  # v1: no slot uses it any more
        path = next((tmp_path / "adapters").rglob("orbit-slot-0-v3"))
        assert {p.name for p in path.iterdir()} == {"adapter_model.safetensors", "adapter_config.json"}
        from transformers import AutoModelForCausalLM

        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama), path).eval()
        prompt = [5, 6, 7, 8]
        greedy = engine.generate(prompt, SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True),
                                 slot=0).result(60)  # what the server serves from the directory it read
        cont = greedy.output_ids
        with torch.no_grad():
            logp = torch.log_softmax(peft_model(torch.tensor([prompt + cont])).logits[0].float(), -1)
        want = logp[torch.arange(3, 3 + len(cont)), torch.tensor(cont)].tolist()
        assert max(abs(a - b) for a, b in zip(greedy.logprobs, want, strict=True)) < 1e-4
        # a bad push is refused and the slot keeps serving what it had
        bad = {k: v * float("nan") for k, v in trainer.adapter_tensors().items()}
        with pytest.raises(EngineError, match="NaN"):
            engine.load_adapter(0, bad, trainer.adapter_config(), 4)
        engine.activate(0)
        assert engine.generate(prompt, SamplingParams(max_new_tokens=4)).result(60).version_start == 3
    finally:
        engine.shutdown()
    assert not list((tmp_path / "adapters").rglob("orbit-slot-*"))


# ---- servers Orbit starts ----------------------------------------------------------------------------


@pytest.mark.timeout(420)
def test_two_started_servers_double_buffer_with_one_killed_mid_run(tmp_path, tiny_llama):
    """Two servers started by Orbit; one is killed mid-run: noticed within seconds, its requests go to
    the other, the run finishes; Orbit's servers are all stopped at the end."""
    run_dir = tmp_path / "run"
    recipe = checked(_recipe(tiny_llama, run_dir, engine={"replicas": 2}, trainer={"steps": 8}))
    # every process already here, with the module's own servers' schedulers and detokenizers: not Orbit's
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    killed: dict = {}

    def kill_one():
        deadline = time.monotonic() + 300
        while not ((run_dir / "metrics.jsonl").exists() and len(run_metrics(run_dir)) >= 3):
            if time.monotonic() > deadline:
                return
            time.sleep(0.2)
        servers = [p for p in psutil.Process().children() if p.pid not in before
                   and "sglang.launch_server" in " ".join(p.cmdline())]
        killed["at"], killed["pid"] = time.time(), servers[-1].pid
        servers[-1].send_signal(signal.SIGKILL)

    import threading

    threading.Thread(target=kill_one, daemon=True).start()
    train(recipe, live=False)
    rows = _check(run_dir, 8)
    assert rows[0]["engines_alive"] == 2 and rows[-1]["engines_alive"] == 1
    lost = next(e for e in run_timeline(run_dir) if e["kind"] == "lost")
    assert lost["t0"] - killed["at"] < 5.0, "a killed server must be noticed within seconds"
    assert "left the pool" in (run_dir / "run.log").read_text()
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE and "sglang" in " ".join(p.cmdline())]
    assert not left, "Orbit must stop every server it started"


@pytest.mark.timeout(420)
def test_two_started_servers_sync(tmp_path, tiny_llama):
    run_dir = tmp_path / "run"
    train(checked(_recipe(tiny_llama, run_dir, mode="sync", engine={"replicas": 2})), live=False)
    rows = _check(run_dir, 3)
    assert all(r["staleness_max"] == 0 and r["full_push"] for r in rows)
    assert {e["engine"] for e in run_timeline(run_dir) if e["kind"] == "request"} == {0, 1}
