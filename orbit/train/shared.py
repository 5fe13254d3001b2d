"""One frozen base model in the trainer, and the adapters trained on it side by side (peft's
multi-adapter model).

A single run has one adapter, peft's "default". A sweep (orbit/sweep/) adds one per run: each run's
`Trainer` owns its adapter's parameters, optimizer and version, and the base is held once. Only one
adapter computes on the base in peft's own forward (it activates one adapter), so `turn(name)` hands
the base to the adapters in the order they asked for it: first come, first served. A run whose
batch is complete first trains first, a slow run never holds back a fast one, and no adapter waits
behind more than one step of each other adapter. `pack(names)` hands it to several adapters at once,
for a pass that carries all of their rows (packing.py).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import peft
import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from orbit.rollout.sample import Sample
from orbit.train.measure import StepResult
from orbit.train.packing import Router


class Packer(Protocol):
    """What runs' trainers call to step with the others ready now (packed.py's StepPacker)."""

    # trainer: a Trainer (trainer.py imports this module)
    def step(self, trainer: Any, samples: list[Sample]) -> StepResult: ...


class FirstComeLock:
    """A lock granted in the order it was asked for (threading.Lock promises no order)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: deque[int] = deque()
        self._tickets = 0

    @contextmanager
    def held(self) -> Iterator[float]:
        """Hold the lock; yields the seconds spent waiting for it."""
        t0 = time.perf_counter()
        with self._cond:
            ticket = self._tickets
            self._tickets += 1
            self._queue.append(ticket)
            while self._queue[0] != ticket:
                self._cond.wait()
        try:
            yield time.perf_counter() - t0
        finally:
            with self._cond:
                self._queue.popleft()
                self._cond.notify_all()


class SharedBase:
    """The base model (loaded once, frozen) and the peft model that holds every adapter added to
    it."""

    def __init__(self, model_path: str | Path, dtype: str, device: str = "cpu") -> None:
        # peft puts each adapter added later on its base layer's device
        self.base: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=getattr(torch, dtype)
        ).to(device)
        self.device = torch.device(device)
        self.model: peft.PeftModel | None = None
        self._active: str | None = None
        self._lock = FirstComeLock()
        self._params: dict[str, list[nn.Parameter]] = {}
        # a sweep's runs' steps, packed (packed.py); None: each in a turn of its own
        self.packer: Packer | None = None

    def add(self, name: str, config: peft.PeftConfig) -> list[nn.Parameter]:
        """Add adapter `name` (initialised from torch's random state, as peft does); returns its
        parameters, in float32 whatever the base's dtype."""
        if self.model is None:
            self.model = peft.get_peft_model(self.base, config, adapter_name=name)
        else:
            self.model.add_adapter(name, config)
        self._activate(name)
        # peft names an adapter's parameters `...lora_A.<name>.weight` (OFT:
        # `...oft_R.<name>.weight`).
        params = [p for key, p in self.model.named_parameters() if f".{name}." in key]
        for p in params:
            p.data = p.data.float()
        self._params[name] = params
        return params

    def remove(self, name: str) -> None:
        """Delete adapter `name` and its parameters (after the turn that holds the base, if any)."""
        with self._lock.held():
            assert self.model is not None, "add an adapter first"
            self.model.delete_adapter(name)
            self._params.pop(name, None)
            if self._active == name:
                self._active = None

    @contextmanager
    def turn(self, name: str) -> Iterator[float]:
        """The base for adapter `name` alone, after those that asked before it; yields the seconds
        waited."""
        with self._lock.held() as waited:
            self._activate(name)
            yield waited

    @contextmanager
    def pack(self, names: list[str]) -> Iterator[Router]:
        """The base for adapters `names` together, after those that asked before; yields the router
        that sends each row of a forward to its adapter (packing.py)."""
        with self.held():
            yield self.routed(names)

    @contextmanager
    def held(self) -> Iterator[float]:
        """The base, for whatever the holder runs on it (`routed`, `use`); yields the seconds
        waited."""
        with self._lock.held() as waited:
            yield waited

    def routed(self, names: list[str]) -> Router:
        """While holding the base: the router for a pass of adapters `names`. Every one of their
        parameters requires grad (peft's `set_adapter` leaves only the active one's so)."""
        assert self.model is not None, "add an adapter first"
        for name in names:
            for p in self._params[name]:
                p.requires_grad_(True)
        self._active = None  # the next turn activates its adapter again, and its grads alone
        return Router(self.model, self.base.get_output_embeddings())

    def use(self, name: str) -> None:
        """While holding the base: peft's own forward computes with adapter `name`."""
        self._activate(name)

    def _activate(self, name: str) -> None:
        assert self.model is not None, "add an adapter first"
        if self._active != name:
            self.model.set_adapter(name)  # also makes only this adapter's parameters require grad
            self._active = name
