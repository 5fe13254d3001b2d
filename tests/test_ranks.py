"""Trainer ranks (orbit/train/ranks.py): how a batch is shared, two ranks computing what one
computes (DDP and FSDP, LoRA and OFT, on CPU with gloo), and a two-rank run from the command line
through its Ctrl-C, the loss of a rank and a resume with one rank."""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from run_helpers import run_metrics

from orbit.config import AdapterConfig, RecipeError, TrainerConfig, parse_recipe
from orbit.rl import AlgorithmConfig
from orbit.rollout.sample import Sample
from orbit.train.launcher import call_on_ranks
from orbit.train.ranks import padded_micro_batches, split_by_tokens
from orbit.train.trainer import Trainer

STEPS = 3
# (adapter, shard, algorithm): the aggregations that count sequences, GSPO's sequence ratio, and
# several optimizer steps per batch (its proximal forward under FSDP too) must add up over ranks as
# over micro-batches
CONFIGS = [
    ("lora", "none", "default"),
    ("lora", "fsdp", "default"),
    ("oft", "none", "default"),
    ("oft", "fsdp", "default"),
    ("lora", "none", "seq-mean"),
    ("lora", "fsdp", "dr_grpo"),
    ("lora", "none", "gspo"),
    ("lora", "fsdp", "decoupled-minibatches"),
]
ALGORITHMS = {
    "default": AlgorithmConfig(),
    "seq-mean": AlgorithmConfig(aggregation="seq-mean-token-mean"),
    "dr_grpo": AlgorithmConfig(preset="dr_grpo"),
    "gspo": AlgorithmConfig(preset="gspo", minibatches=1, clip_eps_high=0.5, clip_eps_low=0.5),
    "decoupled-minibatches": AlgorithmConfig(ratio="decoupled", minibatches=2, epochs=2),
}
ADAPTERS = {
    "lora": AdapterConfig(type="lora", r=4, alpha=8.0),
    "oft": AdapterConfig(
        type="oft", oft_block_size=8, target_modules=["q_proj", "v_proj", "down_proj"]
    ),
}


def _batch(seed: int = 0, groups: int = 5, per_group: int = 3) -> list[Sample]:
    """Groups of samples sharing a prompt, of different prompt and output lengths (one output of one
    token)."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [1] + [rng.randrange(3, 60) for _ in range(2 + g % 4)]
        for j in range(per_group):
            n = 1 if (g, j) == (0, 0) else rng.randrange(2, 9)
            out.append(
                Sample(
                    prompt_ids=prompt,
                    output_ids=[rng.randrange(3, 60) for _ in range(n)],
                    behaviour_logprobs=[-rng.uniform(2.0, 5.0) for _ in range(n)],
                    reward=0.0,
                    version_start=0,
                    version_end=0,
                    loss_mask=[1] * n,
                    advantage=rng.uniform(-1.0, 1.0),
                    group_id=g,
                )
            )
    return out


# ---- sharing a batch -------------------------------------------------------------------------


def test_a_batch_is_shared_by_tokens_and_every_rank_runs_as_many_micro_batches_under_fsdp():
    samples = _batch(groups=7)
    for world in (2, 3, 4):
        shares = split_by_tokens(samples, world)
        assert sorted(id(s) for share in shares for s in share) == sorted(id(s) for s in samples)
        assert all(
            len({tuple(s.prompt_ids) for s in share}) == len({s.group_id for s in share})
            for share in shares
        )  # whole groups
        tokens = [
            sum(len(s.output_ids) for s in share)
            + sum(len(p) for p in {tuple(s.prompt_ids) for s in share})
            for share in shares
        ]
        biggest_group = max(
            len(g[0].prompt_ids) + sum(len(s.output_ids) for s in g)
            for g in ([s for s in samples if s.group_id == i] for i in range(7))
        )
        assert max(tokens) - min(tokens) <= biggest_group
        assert split_by_tokens(samples, world) == shares  # every rank computes the same shares
    few = _batch(groups=1, per_group=3)
    # samples, when groups are too few
    assert [len(share) for share in split_by_tokens(few, 4)] == [1, 1, 1, 0]
    counts = {len(padded_micro_batches(samples, 3, r, 40, pad=True)) for r in range(3)}
    assert len(counts) == 1
    padded = padded_micro_batches(few, 4, 3, 40, pad=True)
    assert padded and not any(counts for _, counts in padded)  # nothing of its own: pads only


def test_recipe_errors_about_ranks_name_the_field(tiny_llama):
    def error(trainer: dict, **recipe) -> str:
        with pytest.raises(RecipeError) as err:
            parse_recipe({"model": str(tiny_llama), "trainer": trainer, **recipe})
        return str(err.value)

    assert "trainer.devices: set trainer.device" in error(
        {"device": "cpu", "devices": ["cpu", "cpu"]}
    )
    assert "trainer.devices: ['cpu', 'cuda:0'] mixes CPU and GPUs" in error(
        {"devices": ["cpu", "cuda:0"]}
    )
    assert "cuda:1 is listed more than once" in error({"devices": ["cuda:1", "cuda:1"]})
    assert "trainer.devices: empty" in error({"devices": []})
    assert "trainer.shard: fsdp" in error(
        {"devices": ["cpu", "cpu"], "shard": "fsdp"}, mode="async-full"
    )
    assert "trainer.shard" in error({"shard": "ddp"})


# ---- two ranks compute what one computes -----------------------------------------------------


def _trainer(
    model: str, adapter: str, shard: str, ranks=None, algorithm: str = "default", budget: int = 48
) -> Trainer:
    cfg = TrainerConfig(lr=0.01, micro_batch_tokens=budget, shard=shard)
    return Trainer(
        model,
        ADAPTERS[adapter],
        cfg,
        temperature=1.0,
        seed=0,
        ranks=ranks,
        algorithm=ALGORITHMS[algorithm],
        max_new_tokens=8,
    )


def _train(
    model: str,
    adapter: str,
    shard: str,
    ranks=None,
    save_to: Path | None = None,
    algorithm: str = "default",
    budget: int = 48,
) -> dict:
    trainer = _trainer(model, adapter, shard, ranks, algorithm, budget)
    init = trainer.adapter_tensors()
    if ranks is not None and not ranks.leader:
        trainer.follow()
        return {}
    steps = []
    for step in range(STEPS):
        # stale after the first: each step re-scores some
        steps.append(trainer.step(_batch(seed=step)))
        # what a push reads on rank 0 alone, between the ranks' collectives
        trainer.adapter_tensors()
        if save_to is not None and step == STEPS - 2:
            trainer.save(save_to)  # rank 0 alone, as a run's checkpoint
    sharded = [p for p in trainer.model.parameters() if type(p.data).__name__ == "DTensor"]
    trainer.close()
    return {
        "loss": [s.loss for s in steps],
        "grad_norm": [s.grad_norm for s in steps],
        "tokens": [s.tokens for s in steps],
        "adapter": trainer.adapter_tensors(),
        "init": init,
        "sharded": [(p.to_local().numel(), p.numel()) for p in sharded[:3]],
    }


def _rank_main(model: str, saves: Path) -> dict:
    """One rank of two (started by torch's launcher): every configuration in turn, in one process
    group."""
    from orbit.train.launcher import launched
    from orbit.train.ranks import Ranks

    torch.set_num_threads(1)
    ranks = Ranks(launched(), ["cpu", "cpu"], timeout_s=60)
    try:
        return {
            f"{a}-{s}-{g}": _train(model, a, s, ranks, saves / f"{a}-{s}-{g}", g)
            for a, s, g in CONFIGS
        }
    finally:
        ranks.close()


@pytest.mark.slow
def test_two_ranks_compute_what_one_rank_computes(tmp_path, tiny_llama):
    """Same batches, same seed, 3 steps: loss, gradient norm and the adapter agree within 1e-5
    (fp32), for DDP and FSDP, LoRA and OFT, and for the aggregations, ratios and optimizer steps of
    orbit/rl. Under FSDP the base really is sharded. A checkpoint two ranks wrote after step 2,
    resumed by one rank, ends step 3 with the same adapter."""
    two = call_on_ranks(2, _rank_main, str(tiny_llama), tmp_path, run_id="test-ranks")
    torch.set_num_threads(1)
    for adapter, shard, algo in CONFIGS:
        got, want = (
            two[f"{adapter}-{shard}-{algo}"],
            _train(str(tiny_llama), adapter, "none", algorithm=algo),
        )
        assert got["tokens"] == want["tokens"]
        for key in ("loss", "grad_norm"):
            assert got[key] == pytest.approx(want[key], abs=1e-5, rel=1e-5), (
                adapter,
                shard,
                algo,
                key,
            )
        assert got["adapter"].keys() == want["adapter"].keys()
        worst = _worst(got["adapter"], want["adapter"])
        # AdamW turns rounding in near-zero gradients into visible steps, and a clip's gradient
        # jumps at its edge (12 optimizer steps in decoupled-minibatches); and a sample's output
        # pass is as long as its length bucket's longest, which differs between a rank's share and
        # the whole batch (batch.length_buckets), so its matmuls round differently, by how much
        # depends on the instruction set: the adapters agree to 5e-3 of their own change (measured,
        # lora/none/seq-mean the worst: 7.1e-4 on AVX-512, 2.0e-3 held to AVX2, 7.9e-4 with no
        # vector kernels; every other configuration 1e-5 to 6e-4)
        change = _worst(want["adapter"], want["init"])
        print(f"{adapter}/{shard}/{algo}: adapters differ by {worst / change:.1e} of their change")
        assert worst <= max(1e-5, 5e-3 * change), (adapter, shard, algo, worst, change)
        if shard == "fsdp":
            assert got["sharded"] and all(local < full for local, full in got["sharded"])
        else:
            assert not got["sharded"]
        resumed = _trainer(str(tiny_llama), adapter, "none", algorithm=algo)
        resumed.load(tmp_path / f"{adapter}-{shard}-{algo}")
        resumed.step(_batch(seed=STEPS - 1))
        last = resumed.adapter_tensors()
        assert max(float((last[k] - got["adapter"][k]).abs().max()) for k in last) <= 1e-5, (
            adapter,
            shard,
            algo,
        )


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b)


# ---- a two-rank run on the command line ------------------------------------------------------


def _recipe(tiny_llama: Path, run_dir: Path, **trainer) -> dict:
    return {
        "model": str(tiny_llama),
        "out": str(run_dir),
        "mode": "double-buffer",
        "adapter": {"type": "lora", "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "engine": {"backend": "embedded", "max_inflight": 8, "max_running": 8, "threads": 1},
        "rollout": {
            "group_size": 4,
            "prompts_per_step": 2,
            "max_new_tokens": 8,
            "stall_timeout_s": 60,
        },
        "trainer": {"lr": 0.02, "steps": 300, "save_every": 100, "threads": 1, **trainer},
        "task": {"name": "pattern", "target": "yes"},
    }


def _orbit(recipe: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "orbit.cli", "train", str(recipe), "--quiet", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _when(check, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def _rank(launcher: subprocess.Popen, rank: int) -> psutil.Process:
    for child in psutil.Process(launcher.pid).children():
        try:
            if child.environ().get("RANK") == str(rank):
                return child
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
    raise AssertionError(f"no rank {rank} among the launcher's children")


def _saved_version(run_dir: Path) -> int:
    return int(json.loads((run_dir / "adapter" / "trainer_state.json").read_text())["version"])


@pytest.mark.alone  # a time bound: no other test beside it
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_ranks_on_the_command_line_ctrl_c_and_a_lost_rank(tmp_path, tiny_llama):
    """Two CPU ranks train a double-buffer run; Ctrl-C on the launcher stops both (rank 0 saves);
    resumed with two ranks, rank 1 is killed: the run stops within the bound, says which rank on
    which host, and saves. Nothing is left running. (A resume with another number of ranks: the test
    above.)"""
    run_dir = tmp_path / "run"
    two = tmp_path / "two.yaml"
    two.write_text(
        yaml.safe_dump(_recipe(tiny_llama, run_dir, devices=["cpu", "cpu"], rank_timeout_s=10))
    )
    started: list[psutil.Process] = []

    def lines() -> int:
        return len(run_metrics(run_dir)) if (run_dir / "metrics.jsonl").exists() else 0

    # 1. Ctrl-C on the launcher after 3 steps: exit 130, the adapter of the last step saved.
    proc = _orbit(two)
    _when(lambda: lines() >= 3, 120, proc)
    started += [_rank(proc, 0), _rank(proc, 1)]
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted at step" in err and "Traceback" not in err
    first = _saved_version(run_dir)
    assert first == run_metrics(run_dir)[-1]["version"] >= 3

    # 2. Resumed with two ranks, rank 1 killed: one line names it and its host, rank 0 saved.
    proc = _orbit(two, "--resume", str(run_dir))
    _when(lambda: lines() >= first + 1, 120, proc)
    started += [_rank(proc, 0), victim := _rank(proc, 1)]
    victim.kill()
    killed = time.monotonic()
    _, err = proc.communicate(timeout=60)
    took = time.monotonic() - killed
    flat = " ".join(err.split())
    assert proc.returncode == 1, err
    assert f"rank 1 on {socket.gethostname()}" in flat and "Traceback" not in err
    assert took < 10 + 5, f"took {took:.1f} s to stop after rank 1 was killed"
    second = _saved_version(run_dir)
    assert second == run_metrics(run_dir)[-1]["version"] > first
    print(f"\nrank 1 killed: the run stopped and saved step {second} in {took:.1f} s")
    assert not [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
