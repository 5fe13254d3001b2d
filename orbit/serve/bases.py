"""The base models one `orbit serve` serves, each known by its names: its engines (a Sampler), the
trainer's copy of its weights (a SharedBase that holds every training client's adapter on it), and
what its engines take (context, vocabulary, LoRA ranks).

A client names a base by any of its names: the recipe's `model:` as written, its absolute path, and
the names the recipe gives it (`serve.names`, `serve.models[i].names`, `--name`). A name belongs to
one base. Refusals show the names but the absolute paths (where the server keeps its files);
`get_server_capabilities` shows a base by its path only when it has no other name.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orbit.serve.clients import LoraSpec
from orbit.serve.futures import Refused
from orbit.serve.samplers import Sampler
from orbit.train.shared import SharedBase


@dataclass(frozen=True)
class EngineLimits:
    """What the engines can load into a slot: any LoRA rank on the embedded engine (None); up to the
    rank SGLang was started with (the recipe's adapter.r) on SGLang."""

    max_rank: int | None = None

    def check(self, spec: LoraSpec) -> None:
        if self.max_rank is not None and spec.rank > self.max_rank:
            raise Refused(
                f"lora_config.rank: {spec.rank}; these SGLang engines load LoRA ranks up to "
                f"{self.max_rank} (the recipe's adapter.r: serve with a higher one)"
            )


@dataclass
class Engines:
    """One base model's engines, as `orbit serve` started them: `model` its checkpoint, `names`
    what clients may call it; `shared` the trainer's copy of its weights, loaded as soon as the
    engines were up (command.py: on a shared GPU the next base's engines are planned on what it
    left)."""

    model: Path
    names: set[str]
    sampler: Sampler
    max_context: int
    vocab_size: int
    shared: SharedBase
    limits: EngineLimits = EngineLimits()


class Base:
    """A served base model: its engines and the trainer's copy of its weights (`shared`)."""

    def __init__(self, engines: Engines) -> None:
        self.model, self.names, self.sampler = engines.model, engines.names, engines.sampler
        self.max_context, self.vocab_size = engines.max_context, engines.vocab_size
        self.limits, self.shared = engines.limits, engines.shared

    def public_names(self) -> list[str]:
        """Its names but its absolute paths."""
        return sorted(n for n in self.names if not n.startswith("/"))

    def check_prompt(self, prompt: list[int], max_tokens: int) -> None:
        """Refused: a prompt its engines cannot take, with `max_tokens` after it."""
        if not prompt:
            raise Refused("prompt: no tokens")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise Refused(
                f"prompt: token id {bad[0]} outside the vocabulary (0..{self.vocab_size - 1})"
            )
        if len(prompt) + max_tokens > self.max_context:
            raise Refused(
                f"sampling_params.max_tokens: {max_tokens} after a prompt of {len(prompt)} tokens "
                f"passes the engines' context of {self.max_context} tokens"
            )


class Bases:
    """Every served base, the first the recipe's own `model:`; a name names one of them (the
    recipe's bases are checked so before they start: command.served)."""

    def __init__(self, served: list[Engines]) -> None:
        if not served:
            raise ValueError("orbit serve serves at least one base model")
        self._bases = [Base(engines) for engines in served]

    def __iter__(self) -> Iterator[Base]:
        return iter(self._bases)

    def __getitem__(self, i: int) -> Base:
        return self._bases[i]

    def __len__(self) -> int:
        return len(self._bases)

    def find(self, name: str) -> Base | None:
        return next((b for b in self._bases if name in b.names), None)

    def named(self, name: str) -> Base:
        """The base a client names; Refused, naming what is served, when none is called so."""
        found = self.find(name)
        if found is None:
            asked = "a model by its path" if str(name).startswith("/") else repr(str(name)[:200])
            raise Refused(f"base_model {asked}: this orbit serve serves {self._shown()}")
        return found

    def same(self, a: str, b: str) -> bool:
        """Whether two names name one served base."""
        found = self.find(a)
        return a == b or (found is not None and found is self.find(b))

    def forget(self, key: str) -> None:
        """Weights no longer sampled (a deleted checkpoint, an ended session): out of every
        engine's slots."""
        for base in self._bases:
            base.sampler.forget(key)

    def capabilities(self) -> list[dict[str, Any]]:
        """The models served (RestClient.get_server_capabilities): each base by each of its
        public names (by its path when it has none)."""
        return [
            {
                "model_name": name,
                "max_context_length": base.max_context,
                "trainable": True,
                "sampleable": True,
            }
            for base in self._bases
            for name in (base.public_names() or [str(base.model)])
        ]

    def _shown(self) -> str:
        """What is served, as a refusal says it (no absolute path)."""
        shown = [" or ".join(b.public_names()) or "a model by its path" for b in self._bases]
        return "; ".join(shown)
