"""No core left idle while the trainer is the bottleneck: the trainer borrows the engines' cores
while they have nothing to generate, and gives them back as soon as generation resumes.

On a CPU machine the engines and the trainer each have their own torch threads (`engine.threads`,
`trainer.threads`). In an overlapped run whose trainer is slower than its engines, admission holds
the engines idle for much of every step (nothing may start until the next version); their cores then
sit unused. The pipeline says when no request is in flight (`engines_idle`); the trainer, on its own
thread, asks `apply()` before each decoder layer's forward and backward and each micro-batch, and
sets its torch thread count to its own threads, plus the engines' while they are idle. torch's
thread count is the calling thread's (an OpenMP setting), so only the trainer's thread can change
it: hence the checks, not a watcher.

Idle OpenMP workers spin for a while before they sleep (GOMP_SPINCOUNT), so a borrowed worker keeps
the engines' core busy for a moment after the trainer gives it back; bench/investigations/cores.py
measures what that costs the engines. They spin only while the trainer's OpenMP team is the
process's one team (orbit/host/threads.py); with a second, every op of a borrowed layer waited for a
woken worker.

The other way round, when the engines are the bottleneck, the trainer's threads go to them while it
waits for a batch: the pipeline's `on_wait` and `Engine.lend_threads` (orbit/run/engines.py).
"""

from __future__ import annotations

import threading

import torch


class Cores:
    """The trainer's torch threads: `own`, plus `lend` while every engine is idle."""

    def __init__(self, own: int, lend: int) -> None:
        self.own, self.lend = own, lend
        self._idle = threading.Event()
        # checks that found the engines idle (what share of the trainer's checks borrowed)
        self.borrowed = 0
        self.checks = 0

    def engines_idle(self, idle: bool) -> None:
        """Called by the pipeline as requests come and go (any thread)."""
        (self._idle.set if idle else self._idle.clear)()

    def apply(self) -> None:
        """On the trainer's thread: its thread count for what it computes next."""
        idle = self._idle.is_set()
        want = self.own + (self.lend if idle else 0)
        self.checks += 1
        self.borrowed += idle
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)

    def hook(self, layers) -> None:
        """Check before each layer's forward and before its backward (a micro-batch is seconds long;
        a layer, tens of ms): the backward check is a hook on the layer's output, which fires as its
        gradient arrives."""

        def on_output(module, args, out) -> None:
            hidden = out[0] if isinstance(out, tuple) else out
            if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
                hidden.register_hook(lambda grad: self.apply())

        for layer in layers:
            layer.register_forward_pre_hook(lambda module, args: self.apply())
            layer.register_forward_hook(on_output)

    def take_share(self) -> float:
        """The share of checks since the last call that borrowed (a step's figure), and start
        counting anew."""
        share = self.borrowed / self.checks if self.checks else 0.0
        self.borrowed = self.checks = 0
        return share
