"""torch's CPU threads, per Python thread.

torch runs CPU ops on OpenMP (the libgomp it ships). Each Python thread has its own count of torch
threads: torch takes it from the process-wide count (the last `torch.set_num_threads` on any thread)
at the thread's first parallel op, and `torch.set_num_threads` sets both the caller's and the
process-wide count. So a thread that computes fixes its own count first thing (`compute_threads`),
and a helper thread that only moves tensors takes one (`helper_thread`).

Why a helper takes one: a thread that runs a parallel op on n > 1 threads keeps a team of n - 1
OpenMP workers for its life. While libgomp counts more of its threads than the machine has cores,
it stops spinning between parallel regions (its throttled spin count, whatever GOMP_SPINCOUNT says):
every worker then sleeps after each op and must be woken for the next. On a 2-core laptop the
pusher's copy of an adapter into shared memory gave the trainer's process a second team, and a
decoder layer on the trainer's 2 threads ran no faster than on 1
(bench/investigations/trainer.md, "The trainer borrowing idle cores").
"""

from __future__ import annotations

import torch


def compute_threads(n: int) -> None:
    """The calling thread computes on `n` torch threads, whatever other threads set later."""
    torch.get_num_threads()  # takes this thread's count from the process-wide one now, not later
    torch.set_num_threads(n)


def helper_thread() -> None:
    """The calling thread only moves tensors: one torch thread, no OpenMP team of its own."""
    compute_threads(1)
