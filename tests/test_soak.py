"""The soak (bench/soak.py) in its short form: two embedded engines Orbit started, every fault once,
and the run comes through each with nothing lost and nothing left behind. The 30-minute figures
(embedded and SGLang servers) are the bench's own; here only what must hold every time is checked,
never a speed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

# alone: it compares /dev/shm before and after, and bounds how soon each fault is noticed
pytestmark = [pytest.mark.slow, pytest.mark.alone]

ROOT = Path(__file__).resolve().parents[1]


def _soak_module():
    spec = importlib.util.spec_from_file_location("soak", ROOT / "bench" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(600)
def test_a_short_soak_survives_every_fault(tmp_path, tiny_llama):
    soak = _soak_module()
    report = soak.soak("embedded", 0.5, tmp_path / "soak", tiny_llama)  # one round: each fault once
    print(soak.table(report))
    kinds = [f.kind for f in report.faults]
    assert set(kinds) == set(soak.FAULTS), kinds  # each fault was injected at least once
    for fault in report.faults:
        assert fault.noticed_s is not None and fault.recovered_s is not None, fault
    assert report.steps > 0 and report.steps_lost == 0 and report.steps_repeated == 0
    assert report.shm_left == [] and report.processes_left == []
    assert report.adapter_loads
