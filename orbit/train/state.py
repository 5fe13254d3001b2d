"""A trainer's state on disk: the adapter in peft's format, the optimizer's state, and the trainer's
own (version, random state, schedule, the run's place), written last: a checkpoint is complete when
it is there (orbit/train/checkpoint.py)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import peft
import torch
from torch import Tensor

from orbit.train.checkpoint import STATE_FILE

OPTIMIZER_FILE = "optimizer.pt"
DEFAULT_ADAPTER = "default"  # peft's name for a model's one adapter


@dataclass
class SavedState:
    """What a checkpoint holds for the trainer, as read from its directory (rank 0 reads, every rank
    restores)."""

    weights: dict[str, Tensor]
    optimizer: dict
    state: dict


def write(directory: Path, model: peft.PeftModel, name: str, optimizer: dict, state: dict) -> None:
    """The adapter `name` of `model` in peft's format, the optimizer's state, then `state` (with the
    RNG's)."""
    directory.mkdir(parents=True, exist_ok=True)
    # the adapter's own weights only (adapter_tensors in peft_adapter.py says why)
    model.save_pretrained(directory, selected_adapters=[name], save_embedding_layers=False)
    # peft puts any other adapter in a directory of its name: one format
    if name != DEFAULT_ADAPTER:
        for path in (directory / name).iterdir():
            path.replace(directory / path.name)
        (directory / name).rmdir()
    torch.save(optimizer, directory / OPTIMIZER_FILE)
    rng = {
        "python": random.getstate(),
        "torch": torch.get_rng_state().tolist(),
        "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()]
        if torch.cuda.is_available()
        else [],
    }
    (directory / STATE_FILE).write_text(json.dumps({**state, "rng": rng}))


def read(directory: Path, model: peft.PeftModel, name: str) -> SavedState:
    """What `write` wrote, checked against the adapter `name` of `model`."""
    weights = peft.utils.load_peft_weights(str(directory), device="cpu")
    expected = set(
        peft.get_peft_model_state_dict(model, adapter_name=name, save_embedding_layers=False)
    )
    if set(weights) != expected:
        raise ValueError(
            f"{directory}: adapter does not match this trainer's adapter config (missing "
            f"{sorted(expected - set(weights))[:3]}, unexpected "
            f"{sorted(set(weights) - expected)[:3]})"
        )
    return SavedState(
        weights,
        torch.load(directory / OPTIMIZER_FILE, map_location="cpu", weights_only=True),
        json.loads((directory / STATE_FILE).read_text()),
    )


def set_rng(rng: dict) -> None:
    """The random state `write` saved, back."""
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(torch.tensor(rng["torch"], dtype=torch.uint8))
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in rng["cuda"]])
