"""One frozen base model in the trainer, and the adapters trained on it side by side (peft's
multi-adapter model).

A single run has one adapter, peft's "default". A sweep (orbit/sweep/) adds one per run: each run's
`Trainer` owns its adapter's parameters, optimizer and version, and the base is held once. Only one
adapter can compute on the base at a time (peft activates one adapter per forward), so `turn(name)`
hands the base to the adapters in the order they asked for it: first come, first served. A run whose
batch is complete first trains first, a slow run never holds back a fast one, and no adapter waits
behind more than one step of each other adapter.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import peft
import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel


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

    def __init__(self, model_path: str | Path, dtype: str) -> None:
        self.base: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=getattr(torch, dtype)
        )
        self.model: peft.PeftModel | None = None
        self._active: str | None = None
        self._lock = FirstComeLock()

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
        return params

    def remove(self, name: str) -> None:
        """Delete adapter `name` and its parameters (after the turn that holds the base, if any)."""
        with self._lock.held():
            assert self.model is not None, "add an adapter first"
            self.model.delete_adapter(name)
            if self._active == name:
                self._active = None

    @contextmanager
    def turn(self, name: str) -> Iterator[float]:
        """The base for adapter `name` alone, after those that asked before it; yields the seconds
        waited."""
        with self._lock.held() as waited:
            self._activate(name)
            yield waited

    def _activate(self, name: str) -> None:
        assert self.model is not None, "add an adapter first"
        if self._active != name:
            self.model.set_adapter(name)  # also makes only this adapter's parameters require grad
            self._active = name
