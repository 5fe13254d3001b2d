"""The trainer borrowing the engines' idle cores (orbit/train/cores.py): when, and what it sets."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from engine_helpers import FakeEngine

from orbit.config import load_recipe
from orbit.config.recipe import RecipeError
from orbit.engine.base import SamplingParams
from orbit.engine.embedded import EngineCore, start_embedded_engine
from orbit.engine.pool import EnginePool
from orbit.run.engines import lendable_cores, trainer_lends
from orbit.train.cores import Cores

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("backend", "borrow", "lends"),
    [
        ("embedded", None, True),  # measured faster on both engines: on unless the recipe says
        ("sglang", None, True),
        ("embedded", False, False),
        ("sglang", False, False),
    ],
)
def test_borrowing_is_on_unless_the_recipe_says(backend, borrow, lends):
    overrides = {"engine.backend": backend, "engine.threads": 1, "trainer.threads": 1}
    if borrow is not None:
        overrides["trainer.borrow_cores"] = borrow
    cores = lendable_cores(load_recipe(ROOT / "recipes" / "tiny.yaml", overrides))
    assert (cores is not None) == lends
    if cores is not None:
        assert (cores.own, cores.lend) == (1, 1)


@pytest.mark.parametrize(
    ("backend", "borrow", "lends"),
    [
        ("embedded", None, True),  # the other way: the engines borrow the waiting trainer's threads
        ("embedded", False, False),
        ("sglang", None, False),  # its threads are fixed when it starts
        ("sglang", False, False),
    ],
)
def test_the_engines_borrow_the_waiting_trainers_threads_unless_the_recipe_says(
    backend, borrow, lends
):
    overrides = {"engine.backend": backend, "trainer.threads": 1}
    if borrow is not None:
        overrides["engine.borrow_cores"] = borrow
    recipe = load_recipe(ROOT / "recipes" / "tiny.yaml", overrides)
    engines = [FakeEngine()]
    pool = EnginePool(engines, [8], monitor=False)
    try:
        waits = trainer_lends(recipe, pool)
        assert (waits is not None) == lends
        if waits is not None:
            waits(True)
            waits(False)
            assert engines[0].calls == [("lend_threads", 1), ("lend_threads", 0)]
    finally:
        pool.shutdown()


def test_borrow_cores_on_an_sglang_engine_fails_at_load_naming_the_field():
    with pytest.raises(RecipeError, match=r"engine\.borrow_cores: the embedded engine's"):
        load_recipe(
            ROOT / "recipes" / "tiny.yaml",
            {"engine.backend": "sglang", "engine.borrow_cores": True},
        )


def test_a_pool_shares_the_trainers_threads_out_among_its_live_engines():
    engines = [FakeEngine(), FakeEngine(), FakeEngine()]
    pool = EnginePool(engines, [8, 8, 8], monitor=False)
    try:
        pool.members[2].alive = False
        pool.lend_threads(3)
        pool.lend_threads(1)
        pool.lend_threads(0)
        lent = [[c[1] for c in e.calls if c[0] == "lend_threads"] for e in engines]
        assert lent == [[2, 1, 0], [1, 0, 0], []]
    finally:
        pool.shutdown()


def test_the_embedded_engine_computes_on_lent_threads_until_they_are_taken_back(tiny_llama):
    """Its loop sets its torch threads before each step, from what `lend_threads` wrote (the
    stats call runs on that loop's thread, so it reports the count the next step computes on)."""

    def threads_become(n: int) -> bool:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if engine.stats().threads == n:
                return True
            time.sleep(0.05)
        return False

    engine = start_embedded_engine(tiny_llama, threads=1, lend_min_work=0)  # every step
    try:
        assert threads_become(1)
        engine.lend_threads(1)
        assert threads_become(2)
        done = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4)).result(60)
        assert len(done.output_ids) >= 1  # it generates on them
        engine.lend_threads(0)
        assert threads_become(1)
    finally:
        engine.shutdown()


def test_lent_threads_are_used_only_for_steps_with_the_work_to_share(tiny_llama):
    """A step of a few rows of a tiny model is 2-10x slower on two threads: the default keeps
    the tests' models on their own."""
    core = EngineCore(str(tiny_llama))
    assert core.step_work() == 0
    for _ in range(40):
        core.submit([1, 2, 3], SamplingParams(max_new_tokens=4))
    assert core.step_work() == 32 * core.weights  # max_running rows, though 40 wait
    assert core.step_work() < core.options.lend_min_work
    engine = start_embedded_engine(tiny_llama, threads=1)
    try:
        engine.lend_threads(1)
        futures = [engine.generate([1, 2, 3], SamplingParams(max_new_tokens=64)) for _ in range(8)]
        seen = {engine.stats().threads for _ in range(20)}
        assert all(len(f.result(60).output_ids) >= 1 for f in futures)
        assert seen == {1}
    finally:
        engine.shutdown()


def test_the_trainer_takes_the_engines_threads_only_while_they_are_idle():
    before = torch.get_num_threads()
    cores = Cores(own=1, lend=1)
    try:
        cores.apply()
        assert torch.get_num_threads() == 1
        cores.engines_idle(True)
        cores.apply()
        assert torch.get_num_threads() == 2
        cores.engines_idle(False)
        cores.apply()
        assert torch.get_num_threads() == 1
        assert cores.take_share() == pytest.approx(1 / 3)
        assert cores.take_share() == 0.0
    finally:
        torch.set_num_threads(before)


# In a fresh interpreter: the main thread on 2 torch threads, a second thread that will train on 2,
# and a tensor copy on a thread that does not call `helper_thread()` and on one that does; each
# copying thread reports the process's threads while it runs (its OpenMP workers among them).
THREADS = """
import os, threading, time, torch
from orbit.host.threads import compute_threads, helper_thread

def tasks():
    return len(os.listdir("/proc/self/task"))

compute_threads(2)
x = torch.randn(4_000_000)
x + 1  # the main thread's OpenMP team
seen = {}

def copy(name, helper):
    if helper:
        helper_thread()
    torch.empty_like(x).copy_(x)
    seen[name] = (tasks() - base, torch.get_num_threads())

# a thread that trains fixes its count, then a helper starts before the trainer's first op
ready, helped = threading.Event(), threading.Event()

def train():
    compute_threads(2)
    ready.set()
    helped.wait(60)
    x + 1
    seen["trainer"] = torch.get_num_threads()

trainer = threading.Thread(target=train)
trainer.start()
ready.wait(60)
base = tasks()
for name, helper in (("plain", False), ("helper", True)):
    t = threading.Thread(target=copy, args=(name, helper))
    t.start()
    t.join()
    # its OpenMP workers leave after it: wait for them (bounded) before the next thread counts
    for _ in range(100):
        if tasks() == base:
            break
        time.sleep(0.1)
helped.set()
trainer.join()
print(*seen["plain"], *seen["helper"], torch.get_num_threads(), seen["trainer"])
"""


POOL_THREADS = """
import sys, torch
sys.path.insert(0, "tests")
from engine_helpers import FakeEngine
from orbit.engine.pool import EnginePool
from orbit.host.threads import compute_threads

compute_threads(2)
pool = EnginePool([FakeEngine(), FakeEngine()], [8, 8], monitor=False)
print(*pool.each(lambda m: torch.get_num_threads()), torch.get_num_threads())
pool.shutdown()
"""


def test_a_pools_calls_to_several_engines_run_on_helper_threads():
    """A push to several engines copies each engine's tensors on a thread of its own: those are
    helpers (one torch thread), not threads that start OpenMP teams beside the trainer's."""
    out = subprocess.run(
        [sys.executable, "-c", POOL_THREADS], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    assert [int(x) for x in out.stdout.split()] == [1, 1, 2]


def test_a_helper_thread_makes_no_openmp_team_and_leaves_the_trainers_threads():
    out = subprocess.run(
        [sys.executable, "-c", THREADS], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    plain, plain_threads, helper, helper_threads, main, trainer = map(int, out.stdout.split())
    # a thread that copies on torch's 2 threads brings an OpenMP worker of its own (2 more threads
    # than before it: the case helper_thread prevents); a helper thread comes alone, on one
    assert (plain, plain_threads) == (2, 2)
    assert (helper, helper_threads) == (1, 1)
    # the threads that compute keep their 2, though the helper set torch's process-wide count to 1
    # before the second one's first op
    assert (main, trainer) == (2, 2)
