"""Device mapping, the `auto` backend and the memory plan of a shared GPU: arithmetic checked on CPU
with the numbers a GPU box would report."""

from __future__ import annotations

import pytest

from orbit.config import RecipeError, parse_recipe
from orbit.engine.devices import sglang_device
from orbit.engine.sglang.process import SGLangOptions
from orbit.engine.sglang.server import launch_args
from orbit.run.placement import GiB, ModelSize, choose_backend, device_problems, plan_colocated
from orbit.run.preflight import preflight, resolve_backend

# Qwen2.5-0.5B-Instruct's shape: 494M parameters, 24 layers, 2 KV heads of 64, vocab 151,936.
QWEN_05B = ModelSize(
    params=494_000_000, layers=24, kv_heads=2, head_dim=64, hidden=896, vocab=151_936
)


def test_sglang_takes_a_device_type_and_a_gpu_id():
    assert sglang_device("cuda:1") == ("cuda", 1)
    assert sglang_device("cuda") == ("cuda", 0)
    assert sglang_device("cpu") == ("cpu", 0)


def test_server_launch_args_map_the_device(tiny_llama):
    from orbit.engine.spec import read_spec

    spec, _ = read_spec(tiny_llama)
    args = launch_args(tiny_llama, SGLangOptions(device="cuda:2"), spec, 30000, 0.4, 2)
    joined = " ".join(args)
    assert (
        "--device cuda --base-gpu-id 2 --tp-size 2" in joined
        and "--mem-fraction-static 0.4" in joined
    )
    assert "cuda:2" not in joined


@pytest.mark.parametrize(
    "args, method",
    [
        (["--device", "cpu"], "fork"),
        (["--device", "cuda", "--base-gpu-id", "1"], "spawn"),
        (["--device", "cpu", "--numa-node", "0"], "spawn"),  # SGLang's NUMA binding asserts spawn
    ],
)
def test_sglangs_spawn_is_a_fork_in_a_cpu_server_orbit_starts(args, method):
    """launch.py's `fork_on_cpu`: SGLang's `set_start_method("spawn", force=True)`, in the process
    that starts a server's scheduler and detokenizer, gives fork on a CPU and spawn otherwise."""
    import subprocess
    import sys

    from orbit.engine.sglang.server import LAUNCH

    program = (
        "import multiprocessing, runpy; "
        f"runpy.run_path({str(LAUNCH)!r}, run_name='launch')['fork_on_cpu']({args!r}); "
        "multiprocessing.set_start_method('spawn', force=True); "
        "print(multiprocessing.get_start_method())"
    )
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True)
    assert out.stdout.strip() == method, out.stderr


def test_auto_backend_choice():
    assert choose_backend(["cuda:0"], sglang_installed=True)[0] == "sglang"
    backend, why = choose_backend(["cuda:0"], sglang_installed=False)
    assert backend == "embedded" and "orbit-rl[sglang]" in why
    assert choose_backend(["cpu"], sglang_installed=True)[0] == "embedded"
    assert choose_backend(["cuda:0", "cpu"], sglang_installed=True)[0] == "embedded"


def test_auto_backend_resolves_at_load_and_says_why(tiny_llama):
    r = preflight(parse_recipe({"model": str(tiny_llama)}))
    assert r.recipe.engine.backend == "embedded"
    [note] = r.notes
    assert note.startswith("engine: embedded (engine.backend auto: the engine runs on cpu")
    attached = parse_recipe(
        {"model": str(tiny_llama), "engine": {"servers": ["http://127.0.0.1:1"]}}
    )
    assert (
        resolve_backend(attached.engine)
        == "engine: sglang-server (engine.backend auto: engine.servers are given)"
    )
    assert attached.engine.backend == "sglang-server"
    assert (
        preflight(parse_recipe({"model": str(tiny_llama), "engine": {"backend": "embedded"}})).notes
        == ()
    )


def test_impossible_device_combinations_name_the_field():
    assert device_problems(["cuda:0"], ["cuda:1"], 1, "sglang", gpu_count=2) == []
    # colocated: allowed
    assert device_problems(["cuda:0"], ["cuda:0"], 1, "sglang", gpu_count=1) == []
    [p] = device_problems(["cpu"], ["cuda:3"], 1, "sglang", gpu_count=2)
    assert p.startswith("engine.device: cuda:3 does not exist") and "cuda:0..cuda:1" in p
    [p] = device_problems(["cuda:0"], ["cpu"], 1, "embedded", gpu_count=0)
    assert p.startswith("trainer.device: cuda:0 does not exist") and "no CUDA GPU" in p
    [p] = device_problems(["cuda:1"], ["cuda:0"], 2, "sglang", gpu_count=2)
    assert p.startswith("trainer.device: cuda:1 is one of engine 0's tensor-parallel GPUs")
    problems = device_problems(["cuda:0"], ["cuda:1"], 2, "embedded", gpu_count=2)
    assert any(p.startswith("engine.tp: 2 needs an SGLang backend") for p in problems)
    assert any(
        "engine.devices" in p
        for p in device_problems(["cpu"], ["cuda:0", "cuda:5"], 1, "sglang", 2)
    )
    # trainer ranks: a world the GPUs cannot give, a rank inside an engine's tensor-parallel group
    [p] = device_problems(["cuda:0", "cuda:1", "cuda:2"], ["cuda:0"], 1, "sglang", gpu_count=2)
    assert p.startswith("trainer.devices: cuda:2 does not exist")
    problems = device_problems(["cuda:2", "cuda:3"], ["cuda:0"], 4, "sglang", gpu_count=4)
    assert [p.split(" is one of engine 0's tensor-parallel GPUs")[0] for p in problems] == [
        "trainer.devices: cuda:2",
        "trainer.devices: cuda:3",
    ]


def test_recipe_on_a_missing_gpu_fails_at_load(tiny_llama):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the check passes here")
    with pytest.raises(
        RecipeError, match=r"trainer.device: cuda:0 does not exist; this machine has no CUDA GPU"
    ):
        preflight(parse_recipe({"model": str(tiny_llama), "trainer": {"device": "cuda:0"}}))


def test_colocated_plan_on_an_80_gib_card():
    plan = plan_colocated(
        QWEN_05B,
        total=80 * GiB,
        free=79 * GiB,
        engine_dtype="bfloat16",
        trainer_dtype="bfloat16",
        tokens=8 * 1536,
        seq=1536,
        max_running=64,
    )
    # a chunk of logits + the activations
    step = 3 * 256 * 151_936 * 4 + 16 * 8 * 1536 * 896 * 24 * 4
    assert plan.trainer_step == step
    trainer_room = 494_000_000 * 2 + step + int(0.05 * 80 * GiB)
    # the rest of the free memory, capped
    fraction = min(0.85, (79 * GiB - trainer_room) / (80 * GiB))
    assert plan.mem_fraction == round(fraction, 3)
    # SGLang's share minus the engine's weights
    assert plan.kv == int(fraction * 80 * GiB) - 494_000_000 * 2
    per_token = 2 * 24 * 2 * 64 * 2
    assert plan.max_context == plan.kv // (per_token * 64)
    assert plan.mem_fraction * 80 * GiB + trainer_room <= 79 * GiB + 0.001 * 80 * GiB


def test_colocated_plan_counts_a_rank_share_of_a_sharded_base():
    args = dict(
        total=80 * GiB,
        free=79 * GiB,
        engine_dtype="bfloat16",
        trainer_dtype="bfloat16",
        tokens=8 * 1536,
        seq=1536,
        max_running=64,
    )
    whole, sharded = plan_colocated(QWEN_05B, **args), plan_colocated(QWEN_05B, **args, shards=4)
    # two layers at once and the whole output projection
    gathered = 2 * 494_000_000 // 24 + 151_936 * 896
    assert sharded.trainer_weights == (494_000_000 // 4 + gathered) * 2 < whole.trainer_weights
    assert sharded.kv > whole.kv  # what the trainer rank no longer holds goes to the engine


def test_colocated_plan_that_cannot_fit_says_the_numbers():
    with pytest.raises(ValueError) as err:
        plan_colocated(
            QWEN_05B,
            total=8 * GiB,
            free=6 * GiB,
            engine_dtype="float32",
            trainer_dtype="float32",
            tokens=32 * 4096,
            seq=4096,
            max_running=256,
        )
    text = str(err.value)
    assert (
        "cannot share this GPU" in text
        and "GiB free" in text
        and "engine KV" in text
        and "model" in text
    )
    with pytest.raises(ValueError, match="engine.mem_fraction 0.9 leaves the trainer too little"):
        plan_colocated(
            QWEN_05B,
            total=80 * GiB,
            free=79 * GiB,
            engine_dtype="bfloat16",
            trainer_dtype="bfloat16",
            tokens=8 * 1536,
            seq=1536,
            max_running=64,
            mem_fraction=0.9,
        )


def test_model_size_of_a_checkpoint(tiny_llama):
    from transformers import AutoModelForCausalLM

    size = ModelSize.of(tiny_llama)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    assert size.params == sum(p.numel() for p in model.state_dict().values())
    assert size.layers == model.config.num_hidden_layers and size.vocab == model.config.vocab_size


@pytest.mark.parametrize(("name", "colocated"), [("qwen-1gpu", True), ("qwen-2gpu", False)])
def test_gpu_recipes_place_trainer_and_engine(name, colocated):
    from pathlib import Path

    from orbit.config import load_recipe

    r = load_recipe(Path(__file__).parent.parent / "recipes" / f"{name}.yaml")
    assert r.engine.backend == "sglang" and r.engine.dtype == r.trainer.dtype == "bfloat16"
    assert (r.trainer.device == r.engine.device) is colocated
    assert (
        device_problems(
            r.trainer.device, r.engine.engine_devices(), r.engine.tp, r.engine.backend, 2
        )
        == []
    )


def test_the_logprob_warning_allows_the_coarsest_dtypes_rounding():
    """bf16 engines differ from the trainer by about 1e-2 with no fault (an H100, SGLang's Triton
    kernels: 0.011-0.013 every step); warning at fp32's 1e-2 would cry wolf every step."""
    from orbit.run.loop import logprob_warn

    assert logprob_warn("float32", "float32") == 1e-2
    assert logprob_warn("bfloat16", "float32") == logprob_warn("float32", "bfloat16") == 5e-2
    assert logprob_warn("float16", "bfloat16") == 5e-2
