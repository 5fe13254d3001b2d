"""`orbit serve` for the tests: the service in this process (its state is there to look at), the
real `tinker` SDK and tinker-cookbook in .venv-tinker (make tinker), run as processes against it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from orbit.config import parse_recipe
from orbit.serve.command import serving as orbit_serving
from orbit.serve.service import Service

ROOT = Path(__file__).resolve().parent.parent
PYTHON = ROOT / ".venv-tinker" / "bin" / "python"
CHECKS = Path(__file__).resolve().parent / "tinker" / "sdk_checks.py"


def sdk_python() -> Path:
    if not PYTHON.exists():
        if os.environ.get("CI"):
            pytest.fail("no .venv-tinker: `make tinker` builds it (CI must run the Tinker tests)")
        pytest.skip("no .venv-tinker (make tinker)")
    return PYTHON


@contextmanager
def serving(model: Path, directory: Path, **sections: dict) -> Iterator[tuple[str, Service]]:
    """`orbit serve` on `model` in this process: the recipe's other `sections` (engine: ...) over an
    embedded engine of 4 slots; (its address, the service)."""
    engine = {"backend": "embedded", "slots": 4, **sections.pop("engine", {})}
    recipe = parse_recipe({"model": str(model), "engine": engine, **sections})
    with orbit_serving(recipe, directory) as served:
        yield served


def sdk(url: str, model: Path, check: str, timeout: float = 240) -> dict:
    """One check of tests/tinker/sdk_checks.py, through the real SDK: what it printed."""
    env = {**os.environ, "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1"}
    res = subprocess.run(
        [str(sdk_python()), str(CHECKS), url, str(model), check],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    lines = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
    assert res.returncode == 0 and lines, (
        f"{check} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    )
    return json.loads(lines[-1].removeprefix("RESULT "))


def adapter(service: Service, model_id: str) -> dict[str, torch.Tensor]:
    return service.client(model_id).trainer.adapter()[0]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def python() -> str:
    return sys.executable
