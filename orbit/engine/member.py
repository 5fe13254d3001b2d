"""What the pool (orbit/engine/pool.py) keeps per member and per request, and the small call helpers
it uses to ask engines that may be dead or hung."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass

from orbit.engine.base import Engine, EngineStats, SamplingParams, Slot

_SUMMED = ("tokens_generated", "busy_s", "paused_s", "running", "waiting", "prefix_cache_entries",
           "prefix_cache_hits", "prefill_tokens", "aborted", "aborted_on_load", "retracted")


@dataclass
class Member:
    index: int
    engine: Engine
    capacity: int  # its max_running: routing balances outstanding / capacity
    alive: bool = True
    version: int = 0  # the policy version it serves (set by the push: `serves`)
    outstanding: int = 0  # requests submitted to it and not answered
    reason: str = ""  # why it left the pool
    reviving: bool = False  # it left, and the reviver is bringing it back
    joined_at: float = 0.0  # time.monotonic() when it last came back


@dataclass
class Request:
    """One caller request; `attempt` changes when it is resubmitted, so a late answer from the
    engine it left is ignored."""

    prompt_ids: list[int]
    sampling: SamplingParams
    slot: Slot
    meta: dict | None
    future: Future
    member: int = -1
    attempt: int = 0
    rid: int = 0


def bounded(call, seconds: float):
    """`call()`'s result, or the exception it raised, or TimeoutError after `seconds` (the call is
    left running in a daemon thread: for asking a possibly hung engine, never for control)."""
    box: list = []

    def run() -> None:
        try:
            box.append(call())
        except BaseException as err:  # noqa: BLE001 - handed back as a value
            box.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    return box[0] if box else TimeoutError(f"no answer within {seconds:g} s")


def outcome(call, member):
    try:
        return call(member), None
    except BaseException as err:  # noqa: BLE001 - sorted out by the caller
        return None, err


def quietly(call) -> None:
    try:
        call()
    except Exception:  # noqa: BLE001 - stopping something already gone
        pass


def summed(parts: list[EngineStats]) -> EngineStats:
    """The members' counters summed (pauses too: engine-seconds paused); slot facts of the first."""
    first = parts[0]
    total = EngineStats(active_slot=first.active_slot, slot_versions=first.slot_versions,
                        slot_requests=first.slot_requests, base_version=first.base_version,
                        paused=any(p.paused for p in parts))
    for name in _SUMMED:
        setattr(total, name, sum(getattr(p, name) for p in parts))
    return total

