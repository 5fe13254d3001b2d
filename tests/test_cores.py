"""The trainer borrowing the engines' idle cores (orbit/train/cores.py): when, and what it sets."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from orbit.config import load_recipe
from orbit.run.engines import lendable_cores
from orbit.train.cores import Cores

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("backend", "borrow", "lends"),
    [
        ("embedded", None, False),  # measured slower beside the embedded engine: off unless asked
        ("sglang", None, True),  # measured faster with SGLang: on
        ("embedded", True, True),
        ("sglang", False, False),
    ],
)
def test_borrowing_follows_the_engine_unless_the_recipe_says(backend, borrow, lends):
    overrides = {"engine.backend": backend, "engine.threads": 1, "trainer.threads": 1}
    if borrow is not None:
        overrides["trainer.borrow_cores"] = borrow
    cores = lendable_cores(load_recipe(ROOT / "recipes" / "tiny.yaml", overrides))
    assert (cores is not None) == lends
    if cores is not None:
        assert (cores.own, cores.lend) == (1, 1)


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
