"""Pytest plugin: tests marked `sglang` need a working sglang 0.5.23.

Where it is missing they skip, except in CI (`CI` set to true/1/yes): there a skipped SGLang test
would hide a broken install behind green runs, so it fails instead, saying why.
"""

from __future__ import annotations

import os

import pytest

from orbit.engine.sglang.install import sglang_problem


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "sglang: needs sglang 0.5.23 (skips without it; fails in CI)"
    )


def pytest_runtest_setup(item) -> None:
    if item.get_closest_marker("sglang") is None:
        return
    problem = sglang_problem()
    if problem is None:
        return
    if in_ci():
        pytest.fail(
            f"sglang is not usable ({problem}); in CI the SGLang tests must run, not skip",
            pytrace=False,
        )
    pytest.skip(f"sglang not available: {problem}")
