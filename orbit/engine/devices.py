"""Device names as the engines take them (the placement checks and the GPU memory plan are
orbit/run/placement.py's)."""

from __future__ import annotations


def gpu_index(device: str) -> int | None:
    """'cuda:2' -> 2, 'cuda' -> 0, 'cpu' -> None."""
    if not device.startswith("cuda"):
        return None
    return int(device.split(":")[1]) if ":" in device else 0


def sglang_device(device: str) -> tuple[str, int]:
    """SGLang takes a device type and a GPU id (`--device cuda --base-gpu-id 1`), not 'cuda:1'."""
    index = gpu_index(device)
    return ("cpu", 0) if index is None else ("cuda", index)
