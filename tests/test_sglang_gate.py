"""In CI a skipped SGLang test is a failure: a broken install must not turn into green skips."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _run(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    # A fake `sglang` 0.0.1 first on the path: sglang_problem() then says the wrong version is
    # installed.
    fake = tmp_path / "fake"
    (fake / "sglang").mkdir(parents=True, exist_ok=True)
    (fake / "sglang" / "__init__.py").write_text("")
    (fake / "sglang-0.0.1.dist-info").mkdir(exist_ok=True)
    (fake / "sglang-0.0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: sglang\nVersion: 0.0.1\n"
    )
    (tmp_path / "test_needs_sglang.py").write_text(
        "import pytest\n\n@pytest.mark.sglang\ndef test_it():\n    pass\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.pathsep.join([str(fake), str(TESTS)])
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "sglang_gate",
            "-p",
            "no:cacheprovider",
            str(tmp_path / "test_needs_sglang.py"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )


def test_a_missing_sglang_skips_outside_ci_and_fails_in_ci(tmp_path):
    out = _run(tmp_path, None)
    assert out.returncode == 0 and "1 skipped" in out.stdout, out.stdout
    out = _run(tmp_path, "true")
    assert out.returncode == 1 and "1 error" in out.stdout, out.stdout  # fails at setup
    assert "sglang 0.0.1 is installed" in out.stdout and "must run, not skip" in out.stdout
