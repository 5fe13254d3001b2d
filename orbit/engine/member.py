"""What the pool (orbit/engine/pool.py) keeps per member and per request."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from orbit.engine.base import Engine, SamplingParams, Slot


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
