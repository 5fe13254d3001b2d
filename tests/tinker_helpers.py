"""`orbit serve` for the tests: the service in this process (its state is there to look at), the
real `tinker` SDK and tinker-cookbook in .venv-tinker (make tinker), run as processes against it."""

from __future__ import annotations

import dataclasses
import importlib.util
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
from orbit.serve.command import Options
from orbit.serve.command import serving as orbit_serving
from orbit.serve.keys import LOCAL
from orbit.serve.service import Service

ROOT = Path(__file__).resolve().parent.parent
PYTHON = ROOT / ".venv-tinker" / "bin" / "python"
CHECKS = Path(__file__).resolve().parent / "tinker" / "sdk_checks.py"


def sdk_python() -> Path:
    """.venv-tinker's interpreter (make tinker); on the lent GPU machine, whose carry brings the SDK
    into the one Python there, that one."""
    if not PYTHON.exists() and importlib.util.find_spec("tinker") is not None:
        return Path(sys.executable)
    if not PYTHON.exists():
        if os.environ.get("CI"):
            pytest.fail("no .venv-tinker: `make tinker` builds it (CI must run the Tinker tests)")
        pytest.skip("no .venv-tinker (make tinker)")
    return PYTHON


@contextmanager
def serving(
    model: Path, directory: Path, options: Options | None = None, **sections: dict
) -> Iterator[tuple[str, Service]]:
    """`orbit serve` on `model` in this process: the recipe's other `sections` (engine: ...) over an
    embedded engine of 4 slots; (its address, the service). `options`: how it serves (its
    directory is `directory`)."""
    engine = {"backend": "embedded", "slots": 4, **sections.pop("engine", {})}
    recipe = parse_recipe({"model": str(model), "engine": engine, **sections})
    options = dataclasses.replace(options or Options(), directory=directory)
    with orbit_serving(recipe, options) as served:
        yield served


def sdk(
    url: str,
    model: Path,
    check: str,
    timeout: float = 240,
    key: str = "tml-local",
    script: Path = CHECKS,
    arg: str | None = None,
) -> dict:
    """One check of tests/tinker/sdk_checks.py (or `script`), through the real SDK with `key`:
    what it printed."""
    res = subprocess.run(
        [str(sdk_python()), str(script), url, str(model), check, *([arg] if arg else [])],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=sdk_env(key),
    )
    lines = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
    assert res.returncode == 0 and lines, (
        f"{check} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    )
    return json.loads(lines[-1].removeprefix("RESULT "))


def sdk_env(key: str) -> dict[str, str]:
    return {**os.environ, "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1", "TINKER_API_KEY": key}


def adapter(service: Service, model_id: str) -> dict[str, torch.Tensor]:
    return service.client(LOCAL, model_id).adapter()[0]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def python() -> str:
    return sys.executable


# what the cookbook's processes run with: offline, the local key, no telemetry
COOKBOOK_ENV = {
    "TINKER_API_KEY": "tml-local",
    "TINKER_TELEMETRY": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


def cookbook_script(name: str, url: str, model: Path | str, log: Path, *more: str) -> str:
    """tests/tinker/`name` (a cookbook entry point driven from Python) against the service at
    `url`, logging to `log`, with `more` arguments: what it printed; it must succeed."""
    script = Path(__file__).parent / "tinker" / name
    model = model.resolve() if isinstance(model, Path) else model
    done = subprocess.run(
        [str(sdk_python()), str(script), url, str(model), str(log), *more],
        capture_output=True,
        text=True,
        timeout=540,
        env={**os.environ, **COOKBOOK_ENV},
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout


def metric_rows(log: Path, having: str | None = None) -> list[dict]:
    """A run's metrics lines, or only those with the key `having`."""
    rows = [json.loads(x) for x in (log / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if having is None or having in r]
