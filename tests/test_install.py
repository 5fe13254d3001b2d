"""Installing Orbit next to a torch that is already there keeps that torch (issue 15).

pyproject.toml declares ranges; constraints.txt pins what this repo's own installs use (the CPU
torch 2.13.0). A user with a CUDA torch runs `pip install orbit-rl` (or `orbit-rl[sglang]`, which
brings sglang 0.5.23 and its torch 2.14.1), so both pins must lie inside the ranges, and pip must
plan no torch at all when the installed one is in range.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from sglang_gate import in_ci

from orbit.engine.sglang.install import SGLANG_VERSION

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
# What sglang 0.5.23's own metadata pins (Requires-Dist), which `orbit-rl[sglang]` must accept.
SGLANG_PINS = {"torch": "2.14.1", "transformers": "5.19.0", "tokenizers": "0.23.2"}
# Lines of pip's output that mean the package index could not be reached (not that resolution
# failed).
OFFLINE = re.compile(
    r"NewConnectionError|Failed to establish a new connection|Network is unreachable|"
    r"Temporary failure in name resolution|ConnectTimeout|Read timed out|ProxyError"
)


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _ranges() -> dict[str, SpecifierSet]:
    reqs = [Requirement(r) for r in _project()["dependencies"]]
    return {canonicalize_name(r.name): r.specifier for r in reqs}


def _constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version.strip()
    return pins


def test_ranges_hold_the_cpu_pins_and_sglangs():
    ranges = _ranges()
    for pins, whose in (
        (_constraints(), "constraints.txt"),
        (SGLANG_PINS, f"sglang {SGLANG_VERSION}"),
    ):
        for name in ("torch", "transformers", "tokenizers"):
            assert pins[name] in ranges[name], (
                f"{whose} pins {name}=={pins[name]}, outside {ranges[name]}"
            )
    # ranges, not pins: a user's CUDA torch of another patch release must satisfy Orbit as it is
    assert "2.14.0" in ranges["torch"] and "2.4.1" not in ranges["torch"]


def test_sglang_pins_above_are_sglangs_own():
    """SGLANG_PINS is read from sglang's metadata where sglang is installed (`make test` installs
    it)."""
    try:
        declared = importlib.metadata.requires("sglang") or []
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("sglang not installed: SGLANG_PINS not cross-checked against its metadata")
    pins = {}
    for line in declared:
        req = Requirement(line)
        if req.marker is None and canonicalize_name(req.name) in SGLANG_PINS:
            pins[canonicalize_name(req.name)] = str(req.specifier)
    assert pins == {name: f"=={v}" for name, v in SGLANG_PINS.items()}


def test_sglang_extra_requests_the_supported_release():
    extra = _project()["optional-dependencies"]["sglang"]
    assert extra == [f"sglang=={SGLANG_VERSION}"]
    script = (ROOT / "scripts" / "install_sglang.sh").read_text()
    # the CPU path installs the same release
    assert f"\nSGLANG_VERSION={SGLANG_VERSION}\n" in script


def test_gpu_tests_are_left_out_of_the_default_run():
    """`make test` must never need a GPU: the default selection deselects `gpu` (make test-gpu
    passes -m gpu)."""
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert options["addopts"][-2:] == ["-m", "not gpu"]
    assert any(m.startswith("gpu:") for m in options["markers"])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_installing_orbit_keeps_the_installed_torch(tmp_path):
    """`pip install --dry-run --report` of Orbit's source into this environment: pip resolves every
    dependency against what is installed (and the index) and plans no torch. Nothing is downloaded
    but setuptools for the metadata build; the source is copied so no build output lands in the
    repo."""
    torch_version = importlib.metadata.version("torch")
    assert torch_version in _ranges()["torch"], (
        f"this environment's torch {torch_version} is outside the range"
    )
    src = tmp_path / "src"
    shutil.copytree(ROOT / "orbit", src / "orbit", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    report = tmp_path / "report.json"
    # short timeouts: without an index pip would otherwise retry for minutes before saying so
    env = {**os.environ, "PIP_DEFAULT_TIMEOUT": "15", "PIP_RETRIES": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--quiet",
            "--report",
            str(report),
            str(src),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=110,
    )
    if done.returncode != 0:
        output = done.stdout + done.stderr
        if OFFLINE.search(output) and not in_ci():
            pytest.skip(f"pip cannot reach the package index: {OFFLINE.search(output).group(0)}")
        pytest.fail(
            f"pip install --dry-run failed (exit {done.returncode}):\n{output[-3000:]}",
            pytrace=False,
        )
    plan = json.loads(report.read_text())["install"]
    planned = {canonicalize_name(i["metadata"]["name"]): i["metadata"] for i in plan}
    assert "torch" not in planned, (
        f"pip would replace torch {torch_version} with {planned['torch']['version']}"
    )
    assert not [n for n in planned if n.startswith("nvidia-")], (
        f"pip would install CUDA wheels: {sorted(planned)}"
    )
    # the metadata as built (what PyPI would carry), not only pyproject's text
    orbit = planned["orbit-rl"]
    assert f'sglang=={SGLANG_VERSION}; extra == "sglang"' in orbit["requires_dist"]
    assert "sglang" in orbit["provides_extra"] and orbit["license_expression"] == "Apache-2.0"
