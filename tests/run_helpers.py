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


def check_no_request_ran_on_a_slot_being_written(events: list[dict]) -> int:
    """No finished request on a slot was running at the engine's write time of that slot; returns
    how many slot writes were checked.

    The write time is the engine's own (`written`): the trainer's span of the call also covers the
    tensor transfer, during which the engine may rightly still finish requests on that slot.
    """
    loads = [e for e in events if e["kind"] == "load_adapter"]
    requests = [e for e in events if e["kind"] == "request" and e["finish"] != "abort"]
    for load in loads:
        assert load["t0"] <= load["written"] <= load["t1"], load
        for req in requests:
            if req["slot"] == load["slot"]:
                assert not req["t0"] < load["written"] < req["t1"], \
                    f"request on slot {req['slot']} ran while that slot was written: {req} {load}"
    for req in requests:
        if req["slot"] is not None:
            assert req["version"] == req["version_end"], f"a request saw its slot change under it: {req}"
    return len(loads)
