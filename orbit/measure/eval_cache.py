"""The base model's held-out result, kept so that `orbit eval RUN` does not evaluate it again.

Every run of a recipe shares its base model, and the base's greedy episodes on the same held-out
prompts are the same work each time (4 of the agent recipe's 6 minutes of `orbit eval`). The
result is stored under `<cache>/eval/<key>.json` (cache = $ORBIT_CACHE or `.cache`), the key a hash
of everything that shapes it: the model's files (name, size, modification time), the prompts
themselves (so a changed dataset is a new key), the bounds an episode runs within, and the source
of the whole `orbit` package with torch's and transformers' versions (a change to the engine, the
tasks or the scoring evaluates afresh), and the machine's floats (orbit/host/floats.py: a cache
carried to another machine is not read there). `orbit eval --fresh-base` evaluates it again
regardless.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
import transformers

import orbit
from orbit.host.files import cache_root
from orbit.host.floats import float_kernels


def _code_version() -> str:
    h = hashlib.sha256()
    package = Path(str(orbit.__file__)).parent
    for f in sorted(package.rglob("*.py")):
        h.update(str(f.relative_to(package)).encode())
        h.update(f.read_bytes())
    h.update(torch.__version__.encode())
    h.update(transformers.__version__.encode())
    h.update(float_kernels().encode())
    return h.hexdigest()


def _model_files(model: Path, skip: tuple[str, ...]) -> list[tuple[str, int, int]]:
    return [
        (f.name, f.stat().st_size, f.stat().st_mtime_ns)
        for f in sorted(Path(model).iterdir())
        if f.is_file() and f.name not in skip
    ]


def base_key(model: Path, prompts: list, bounds: dict[str, Any], skip: tuple[str, ...] = ()) -> str:
    """The hash that names one base result: model files, prompts, episode bounds, code. `skip`:
    files in the model directory that are not the model (what `orbit eval` writes there)."""
    data = {
        "model": str(Path(model).resolve()),
        "files": _model_files(model, skip),
        "prompts": [[p.id, p.text, p.answer, list(p.prompt_ids)] for p in prompts],
        "bounds": bounds,
        "code": _code_version(),
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:24]


def path_for(key: str, root: Path | None = None) -> Path:
    return (root or cache_root()) / "eval" / f"{key}.json"


def load(key: str, root: Path | None = None) -> dict | None:
    """{"summary": ..., "records": [...]} as stored, or None (missing or unreadable)."""
    try:
        data = json.loads(path_for(key, root).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and {"summary", "records"} <= set(data) else None


def store(key: str, summary: dict, records: list[dict], root: Path | None = None) -> Path:
    """Written to a temporary file and renamed: a reader sees all of it or none."""
    path = path_for(key, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"summary": summary, "records": records}))
    os.replace(tmp, path)
    return path
