"""What a task is: a stream of prompts and a verifier that scores completions."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    prompt_ids: tuple[int, ...]
    answer: str = ""


@dataclass
class Score:
    reward: float
    info: dict = field(default_factory=dict)  # correct, format_ok, failure_mode, ...


class Task(Protocol):
    name: str

    def prompts(self, seed: int) -> Iterator[Prompt]:
        """An endless, deterministic stream of prompts for this seed."""
        ...

    def score(self, prompt: Prompt, output_ids: list[int]) -> Score: ...
