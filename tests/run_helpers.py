"""Shared by the end-to-end tests: recipe dicts with section patches, and a run's JSON lines."""

from __future__ import annotations

import json
from pathlib import Path


def patched(data: dict, patch: dict) -> dict:
    """`data` with `patch` applied: a dict value updates that section, anything else replaces."""
    for key, value in patch.items():
        if isinstance(value, dict):
            data.setdefault(key, {}).update(value)
        else:
            data[key] = value
    return data


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run_metrics(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "metrics.jsonl")


def run_timeline(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "timeline.jsonl")
