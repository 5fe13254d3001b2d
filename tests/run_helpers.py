"""Shared by the end-to-end tests: recipe dicts with section patches, runs, and a run's JSON
lines."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import psutil

from orbit.config import parse_recipe
from orbit.run.preflight import Checked, preflight

# A small, fast run of the tiny model: what most end-to-end tests start from.
SMALL_RUN = {
    "adapter": {"type": "lora", "r": 4, "alpha": 8},
    "engine": {"max_inflight": 16, "max_running": 16},
    "rollout": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 12},
    "trainer": {"lr": 0.01, "steps": 3, "save_every": 1000},
    # the loss these tests' figures were set against; the default (DAPO) has its own tests
    # (tests/test_default_run.py) and every recipe written without a preset runs it
    "algorithm": {"preset": "orbit_v1"},
    "seed": 1,
}


def patched(data: dict, patch: dict) -> dict:
    """`data` with `patch` applied: a dict value updates that section, anything else replaces."""
    for key, value in patch.items():
        if isinstance(value, dict):
            data.setdefault(key, {}).update(value)
        else:
            data[key] = value
    return data


def recipe_dict(model: Path, out: Path, *defaults: dict, **patch) -> dict:
    """SMALL_RUN on `model` writing to `out`, then each of `defaults` (a test file's own), then
    `patch`."""
    data = {**copy.deepcopy(SMALL_RUN), "model": str(model), "out": str(out)}
    for d in (*defaults, patch):
        patched(data, copy.deepcopy(d))
    return data


def checked(data: dict) -> Checked:
    """A recipe dict parsed and preflighted, as `orbit train` does before a run."""
    return preflight(parse_recipe(data))


def read_jsonl(path: Path) -> list[dict]:
    """The complete lines (a test polling a running run may catch the writer mid-line)."""
    text = path.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def run_metrics(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "metrics.jsonl")


def run_timeline(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "timeline.jsonl")


def check_no_request_ran_on_a_slot_being_written(
    events: list[dict], retract_ok: bool = False
) -> int:
    """Per engine: no finished request on a slot was running at that engine's write time of the
    slot, and every request's version is the version its slot held when it started (the last write
    before it). Returns how many slot writes were checked.

    `retract_ok`: a one-slot push on the embedded engine retracts the slot's running requests and
    recomputes them under the new adapter; such a request must name the write that retracted it
    (version_end = that write's version, written while it ran).

    The write time is the engine's own (`written`): the trainer's span of the call also covers the
    tensor transfer, during which the engine may rightly still finish requests on that slot.
    """
    loads = [e for e in events if e["kind"] == "load_adapter"]
    requests = [e for e in events if e["kind"] == "request" and e["finish"] != "abort"]
    for load in loads:
        assert load["t0"] <= load["written"] <= load["t1"], load
        for req in requests:
            # A request retracted by the push's pause and recomputed under the new adapter does span
            # the write, and says so: its version_end is the new version.
            unchanged = req.get("version_end", req["version"]) == req["version"]
            if (req.get("engine", 0), req["slot"]) == (
                load.get("engine", 0),
                load["slot"],
            ) and unchanged:
                assert not req["t0"] < load["written"] < req["t1"], (
                    f"a request ran on its slot while that slot was written: {req} {load}"
                )
    for req in requests:
        if req["slot"] is None:
            continue
        same = (req.get("engine", 0), req["slot"])
        if retract_ok and req["version_end"] != req["version"]:
            assert any(
                (x.get("engine", 0), x["slot"]) == same
                and x["version"] == req["version_end"]
                and req["t0"] < x["written"] < req["t1"]
                for x in loads
            ), f"retracted by no write: {req}"
        else:
            assert req["version"] == req["version_end"], (
                f"a request saw its slot change under it: {req}"
            )
        before = [
            x
            for x in loads
            if (x.get("engine", 0), x["slot"]) == same and x["written"] <= req["t0"]
        ]
        if before:  # (the initial load before the run is not on the timeline)
            assert max(before, key=lambda x: x["written"])["version"] == req["version"], (
                f"a request's version is not its slot's: {req}"
            )
    return len(loads)


def engine_processes(orbit: psutil.Process) -> list[psutil.Process]:
    """The embedded engine processes under an Orbit process, live ones (they fork from its fork
    server, orbit/host/forks.py, and name themselves)."""
    found = []
    for child in orbit.children(recursive=True):
        try:
            if child.name() == "orbit-engine" and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child)
        except psutil.Error:  # gone meanwhile
            pass
    return found
