"""One training run, from the recipe to its last step: checks before any compute (preflight.py),
where things run (placement.py), the run's directory (directory.py), its start and stop
(lifecycle.py), its engines (engines.py), the loop (loop.py), engines that come back (revive.py),
samples.jsonl, TensorBoard and W&B (trackers.py), and how a run ends (ends.py).

`from orbit.run import train` is the entry point for code that runs a recipe."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orbit.run.ends import RunStopped
    from orbit.run.lifecycle import RunResult, train

__all__ = ["RunResult", "RunStopped", "train"]


def __getattr__(name: str) -> Any:
    # Imported on first use (PEP 562): the command line imports orbit.run.preflight before any run,
    # and the run's pieces (torch, the engines, the trainer) must not come with it.
    if name == "RunStopped":
        from orbit.run.ends import RunStopped

        return RunStopped
    if name in ("RunResult", "train"):
        from orbit.run import lifecycle

        return getattr(lifecycle, name)
    raise AttributeError(f"module 'orbit.run' has no attribute {name!r}")
