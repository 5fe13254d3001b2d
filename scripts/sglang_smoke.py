"""Smoke test and numerics check of the SGLang backend's building blocks on this machine.

    .venv-sglang/bin/python scripts/sglang_smoke.py                 # smoke: start, generate, LoRA,
    control .venv-sglang/bin/python scripts/sglang_smoke.py --numerics      # + LoRA-vs-peft table
    (slower) .venv-sglang/bin/python scripts/sglang_smoke.py --model DIR     # an existing HF
    checkpoint

Needs a venv made by `bash scripts/install_sglang.sh VENV` plus Orbit's own requirements
(`pip install -c constraints.txt -e .`). On a CPU-only machine it turns on Orbit's shims
(orbit.engine.sglang_cpu) before importing sglang. Prints one `OK ...`/`FAIL ...` line per check
and exits non-zero if any failed. Everything runs in-process against `sglang.Engine` with its
event loop driven from a second thread, the way the Orbit backend drives it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NUMERICS_SETS = {
    "o_proj": ["o_proj"],
    "q_proj": ["q_proj"],
    "k_proj": ["k_proj"],
    "v_proj": ["v_proj"],
    "q,k,v": ["q_proj", "k_proj", "v_proj"],
    "all 7": ALL_TARGETS,
}

failures: list[str] = []


def check(ok: bool, what: str, detail: str = "") -> None:
    print(f"{'OK  ' if ok else 'FAIL'} {what}{(': ' + detail) if detail else ''}", flush=True)
    if not ok:
        failures.append(what)


# ---------------------------------------------------------------------------------------------
# models and adapters (reference side: transformers + peft, fp32)


def tiny_model(out: Path, arch: str, kv_heads: int | None = None) -> Path:
    """orbit.models.tiny's model; with kv_heads set, the same recipe with that many KV heads."""
    from orbit.models.tiny import build_tiny_model, build_tokenizer, tiny_config

    if kv_heads is None:
        return build_tiny_model(out, arch)
    from transformers import AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(0)
    cfg = tiny_config(arch, len(tok), tok)
    cfg.num_key_value_heads = kv_heads
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
            elif "bias" in name:
                p.normal_(0.0, 0.02)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def random_lora(
    model_dir: Path, targets: list[str], r: int = 8, alpha: float = 16.0, seed: int = 1
):
    """A peft LoRA with random non-zero A and B, exported the way Orbit exports it."""
    import peft
    from transformers import AutoModelForCausalLM

    from orbit.train.trainer import adapter_config_dict, adapter_tensors

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = peft.LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM"
    )
    model = peft.get_peft_model(base, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.eval()
    return model, adapter_tensors(model), adapter_config_dict(model)


def teacher_forced(model, ids: list[int]) -> list[float]:
    """log p(ids[t] | ids[:t]) for t >= 1, fp32."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [lp[t - 1, ids[t]].item() for t in range(1, len(ids))]


def max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------------------------------------
# engine side


class LoopThread:
    """Runs `engine.loop` forever in a daemon thread; `call(coro)` runs a coroutine on it.

    `sglang.Engine`'s synchronous methods are `loop.run_until_complete(tokenizer_manager.X(...))`,
    so they cannot overlap a running generation. Once this thread owns the loop, *every* call
    must go through `call()`/`submit()` (the sync methods would fail: the loop is running)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.thread = threading.Thread(target=loop.run_forever, name="sglang-loop", daemon=True)
        self.thread.start()

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro, timeout: float = 120.0):
        return self.submit(coro).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def start_engine(model_dir: Path, max_lora_rank: int):
    from sglang.srt.entrypoints.engine import Engine

    t0 = time.perf_counter()
    engine = Engine(
        model_path=str(model_dir),
        device="cpu" if not torch.cuda.is_available() else "cuda",
        attention_backend="torch_native",
        sampling_backend="pytorch",
        dtype="float32",
        disable_cuda_graph=True,
        enable_lora=True,
        lora_backend="torch_native",  # the default (csgmv) is a Triton GPU kernel
        max_lora_rank=max_lora_rank,
        lora_target_modules=ALL_TARGETS,
        max_loras_per_batch=2,
        mem_fraction_static=0.05,
        max_total_tokens=4096,
        context_length=512,
        log_level="error",
    )
    return engine, time.perf_counter() - t0


def prompt_logprobs(engine, ids: list[int], lora: str | None) -> list[float]:
    out = engine.generate(
        input_ids=ids,
        sampling_params={"max_new_tokens": 1, "temperature": 0.0},
        return_logprob=True,
        logprob_start_len=0,
        lora_path=lora,
    )
    return [lp for lp, _tok, _txt in out["meta_info"]["input_token_logprobs"][1:]]


# ---------------------------------------------------------------------------------------------


def smoke(model_dir: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from orbit.engine.sglang_cpu.adapter_format import to_sglang_lora

    engine, start_s = start_engine(model_dir, max_lora_rank=8)
    print(f"engine start: {start_s:.1f} s", flush=True)
    mcfg = AutoConfig.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(7)
    ids = [1] + torch.randint(3, 384, (40,), generator=gen).tolist()

    # 1. base generation with logprobs, and base numerics vs transformers
    out = engine.generate(
        input_ids=ids[:8],
        sampling_params={"max_new_tokens": 16, "temperature": 0.0},
        return_logprob=True,
    )
    lps = out["meta_info"]["output_token_logprobs"]
    check(
        len(out["output_ids"]) == 16 and all(math.isfinite(lp) for lp, _, _ in lps),
        "generate(return_logprob=True)",
        f"{len(lps)} (logprob, token_id, text) triples",
    )
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    d = max_abs_diff(teacher_forced(base, ids), prompt_logprobs(engine, ids, None))
    check(d < 1e-4, "base logprobs vs transformers (teacher-forced)", f"max|diff| = {d:.2e}")

    # 2. throughput: one request, then 8 at once (ignore_eos so every one runs to length);
    #    best of 3, since this 2-core machine is often shared with other work
    for n in (1, 8):
        sp = {"max_new_tokens": 128, "temperature": 1.0, "ignore_eos": True}
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            outs = engine.generate(input_ids=[ids[:8]] * n, sampling_params=sp)
            best = min(best, time.perf_counter() - t0)
        toks = sum(len(o["output_ids"]) for o in outs)
        print(
            f"throughput, {n} request(s) x 128 tokens: {toks / best:.0f} tok/s (best of 3: "
            f"{best:.2f} s)",
            flush=True,
        )

    # 3. one adapter under two names (the two slots), via the Orbit export + SGLang format
    peft_model, tensors, config = random_lora(model_dir, ["q_proj", "v_proj", "o_proj"])
    tensors, config = to_sglang_lora(tensors, config, mcfg)
    for name in ("orbit-slot-0", "orbit-slot-1"):
        t0 = time.perf_counter()
        res = engine.load_lora_adapter_from_tensors(name, tensors, config)
        check(
            res.success,
            f"load_lora_adapter_from_tensors({name!r})",
            f"{time.perf_counter() - t0:.3f} s" if res.success else res.error_message,
        )
    ref = teacher_forced(peft_model, ids)
    for name in ("orbit-slot-0", "orbit-slot-1"):
        d = max_abs_diff(ref, prompt_logprobs(engine, ids, name))
        check(d < 1e-4, f"LoRA logprobs vs peft ({name})", f"max|diff| = {d:.2e}")
    outs = engine.generate(
        input_ids=[ids, ids],
        sampling_params={"max_new_tokens": 1, "temperature": 0.0},
        return_logprob=True,
        logprob_start_len=0,
        lora_path=["orbit-slot-0", None],
    )
    got = [[lp for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]] for o in outs]
    d0, d1 = max_abs_diff(ref, got[0]), max_abs_diff(teacher_forced(base, ids), got[1])
    check(max(d0, d1) < 1e-4, "mixed batch [slot-0, base]", f"max|diff| = {d0:.2e}, {d1:.2e}")
    res = engine.unload_lora_adapter("orbit-slot-1")
    check(res.success, "unload_lora_adapter('orbit-slot-1')")
    res = engine.load_lora_adapter_from_tensors("orbit-slot-1", tensors, config)
    check(res.success, "reload under the same name after unload")

    # 4. full-weight push: update_weights_from_tensor with HF names (LoRA enabled)
    sd = {k: v.clone() for k, v in base.state_dict().items()}
    torch.manual_seed(3)
    named = []
    for k in (
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "lm_head.weight",
    ):
        sd[k] = sd[k] + 0.05 * torch.randn_like(sd[k])
        named.append((k, sd[k]))
    t0 = time.perf_counter()
    # 0.5.23: a push must be inside a weight-update session, else it fails with
    # "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
    ok0, msg0 = engine.begin_weight_update()
    ok, msg = engine.update_weights_from_tensor(
        named_tensors=named, load_format=None, flush_cache=True
    )
    ok1, msg1 = engine.end_weight_update()
    check(
        ok0 and ok and ok1,
        "begin_weight_update + update_weights_from_tensor([(hf_name, tensor)]) + end",
        f"{time.perf_counter() - t0:.3f} s: {msg0} / {msg} / {msg1}",
    )
    base.load_state_dict(sd)
    d = max_abs_diff(teacher_forced(base, ids), prompt_logprobs(engine, ids, None))
    check(
        d < 1e-4,
        "base logprobs after the push match transformers with the new weights",
        f"max|diff| = {d:.2e}",
    )

    # 5. release/resume memory (no-op on CPU: torch_memory_saver is off), then still generating
    t0 = time.perf_counter()
    engine.release_memory_occupation()
    engine.resume_memory_occupation()
    d = max_abs_diff(teacher_forced(base, ids), prompt_logprobs(engine, ids, None))
    check(
        d < 1e-4,
        "release_memory_occupation() + resume_memory_occupation()",
        f"{time.perf_counter() - t0:.3f} s, logprobs unchanged (max|diff| = {d:.2e})",
    )

    # 6. control while generating: the loop in its own thread, everything as coroutines
    control_while_generating(engine, ids, tensors, config, dict(named))
    engine.shutdown()


def control_while_generating(engine, ids, tensors, config, push_tensors) -> None:
    from sglang.srt.managers.io_struct import (
        ContinueGenerationReqInput,
        LoadLoRAAdapterFromTensorsReqInput,
        PauseGenerationReqInput,
        UnloadLoRAAdapterReqInput,
    )
    from sglang.srt.utils import MultiprocessingSerializer

    tm = engine.tokenizer_manager
    lt = LoopThread(engine.loop)
    sp = {"max_new_tokens": 200, "temperature": 1.0, "ignore_eos": True}

    def launch(n, lora):
        return [
            lt.submit(
                engine.async_generate(
                    input_ids=ids[:8], sampling_params=sp, lora_path=lora, return_logprob=True
                )
            )
            for _ in range(n)
        ]

    try:
        for mode in ("in_place", "retract", "abort"):
            futs = launch(3, "orbit-slot-0")
            time.sleep(0.5)
            t0 = time.perf_counter()
            lt.call(tm.pause_generation(PauseGenerationReqInput(mode=mode)))
            pause_s = time.perf_counter() - t0
            flushed = lt.call(tm.flush_cache())
            # swap the inactive slot while paused (no request uses it): unload + load
            r1 = lt.call(
                tm.unload_lora_adapter(UnloadLoRAAdapterReqInput(lora_name="orbit-slot-1"), None)
            )
            req = LoadLoRAAdapterFromTensorsReqInput(
                lora_name="orbit-slot-1",
                config_dict=config,
                serialized_named_tensors=[MultiprocessingSerializer.serialize(tensors)],
            )
            r2 = lt.call(tm.load_lora_adapter_from_tensors(req, None))
            time.sleep(0.3)
            done_while_paused = sum(f.done() for f in futs)
            lt.call(tm.continue_generation(ContinueGenerationReqInput()))
            outs = [f.result(120) for f in futs]
            reasons = sorted({o["meta_info"]["finish_reason"]["type"] for o in outs})
            lens = [len(o["output_ids"]) for o in outs]
            check(
                r1.success and r2.success and (mode == "abort" or done_while_paused == 0),
                f"pause_generation(mode={mode!r}) + swap slot-1 + continue_generation",
                f"pause {pause_s:.3f} s, flush_cache success={flushed.success}, finish={reasons}, "
                f"lengths={lens}",
            )
        # full-weight push while paused (retract), as the overlapped full-push modes do it
        from sglang.srt.managers.io_struct import (
            BeginWeightUpdateReqInput,
            EndWeightUpdateReqInput,
            UpdateWeightsFromTensorReqInput,
        )

        futs = launch(3, None)
        time.sleep(0.3)
        named = [(k, v.clone()) for k, v in push_tensors.items()]
        t0 = time.perf_counter()
        lt.call(tm.pause_generation(PauseGenerationReqInput(mode="retract")))
        b = lt.call(tm.begin_weight_update(BeginWeightUpdateReqInput(), None))
        u = lt.call(
            tm.update_weights_from_tensor(
                UpdateWeightsFromTensorReqInput(
                    serialized_named_tensors=[MultiprocessingSerializer.serialize(named)],
                    load_format=None,
                    flush_cache=True,
                ),
                None,
            )
        )
        e = lt.call(tm.end_weight_update(EndWeightUpdateReqInput(), None))
        lt.call(tm.continue_generation(ContinueGenerationReqInput()))
        push_s = time.perf_counter() - t0
        outs = [f.result(120) for f in futs]
        check(
            b[0] and u[0] and e[0] and all(len(o["output_ids"]) == 200 for o in outs),
            "pause(retract) + begin/update_weights_from_tensor/end + continue while generating",
            f"{push_s:.3f} s: {b[1]} / {u[1]} / {e[1]}",
        )
        # load into the inactive slot while the active one is generating (no pause)
        futs = launch(3, "orbit-slot-0")
        time.sleep(0.3)
        lt.call(tm.unload_lora_adapter(UnloadLoRAAdapterReqInput(lora_name="orbit-slot-1"), None))
        req = LoadLoRAAdapterFromTensorsReqInput(
            lora_name="orbit-slot-1",
            config_dict=config,
            serialized_named_tensors=[MultiprocessingSerializer.serialize(tensors)],
        )
        t0 = time.perf_counter()
        res = lt.call(tm.load_lora_adapter_from_tensors(req, None))
        load_s = time.perf_counter() - t0
        running = sum(not f.done() for f in futs)
        outs = [f.result(120) for f in futs]
        check(
            res.success and all(len(o["output_ids"]) == 200 for o in outs),
            "load into slot-1 while slot-0 generates",
            f"{load_s:.3f} s, {running} requests still running then",
        )
    finally:
        lt.stop()


def numerics(workdir: Path) -> None:
    """LoRA vs peft, teacher-forced, per target set, on GQA and non-GQA tiny Llama and Qwen2."""
    from transformers import AutoConfig

    from orbit.engine.sglang_cpu.adapter_format import to_sglang_lora

    rows = []
    for arch, kv in (("llama", 2), ("llama", 4), ("qwen2", 2)):
        model_dir = tiny_model(workdir / f"{arch}-kv{kv}", arch, kv_heads=kv)
        mcfg = AutoConfig.from_pretrained(model_dir)
        engine, _ = start_engine(model_dir, max_lora_rank=8)
        gen = torch.Generator().manual_seed(7)
        ids = [1] + torch.randint(3, 384, (40,), generator=gen).tolist()
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        d = max_abs_diff(teacher_forced(base, ids), prompt_logprobs(engine, ids, None))
        rows.append((arch, kv, "base", "-", d))
        for i, (label, targets) in enumerate(NUMERICS_SETS.items()):
            for r in (8, 4):
                model, tensors, config = random_lora(
                    model_dir, targets, r=r, alpha=2.0 * r, seed=10 * i + r
                )
                tensors, config = to_sglang_lora(tensors, config, mcfg)
                name = f"n{i}r{r}"
                res = engine.load_lora_adapter_from_tensors(name, tensors, config)
                if not res.success:
                    rows.append((arch, kv, label, r, float("nan")))
                    check(False, f"load {label} r={r} on {arch} kv={kv}", res.error_message)
                    continue
                rows.append(
                    (
                        arch,
                        kv,
                        label,
                        r,
                        max_abs_diff(
                            teacher_forced(model, ids), prompt_logprobs(engine, ids, name)
                        ),
                    )
                )
                engine.unload_lora_adapter(name)
        engine.shutdown()
    print(
        "\n| model | kv heads | target set | r (max_lora_rank 8) | max abs logprob diff vs peft |"
    )
    print("|---|---|---|---|---|")
    for arch, kv, label, r, d in rows:
        print(f"| tiny {arch} | {kv} of 4 | {label} | {r} | {d:.1e} |")
    worst = max(d for *_, d in rows)
    check(worst < 1e-4, "LoRA numerics table", f"worst max|diff| = {worst:.1e}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model", type=Path, help="HF checkpoint dir (default: build orbit.models.tiny's llama)"
    )
    ap.add_argument("--numerics", action="store_true", help="also run the LoRA-vs-peft table")
    args = ap.parse_args()

    if not torch.cuda.is_available():
        from orbit.engine.sglang_cpu import prepare_cpu_environment

        prepare_cpu_environment()  # before anything imports sglang (or torchvision)
    with tempfile.TemporaryDirectory(prefix="orbit-sglang-smoke-") as tmp:
        model_dir = args.model or tiny_model(Path(tmp) / "tiny-llama", "llama")
        smoke(model_dir)
        if args.numerics:
            numerics(Path(tmp))
    print(json.dumps({"failed": failures}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
