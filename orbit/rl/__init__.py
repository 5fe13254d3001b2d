"""The RL math, and nothing else: advantage estimators, reward shaping and filters, the policy loss
and its aggregation, and the named presets. Plain numbers and tensors in and out; the rollout
pipeline and the trainer call it (docs/algorithms.md)."""

from orbit.rl.advantages import advantages
from orbit.rl.config import AlgorithmConfig, MaskBand
from orbit.rl.filters import (
    call_lengths,
    carries_signal,
    left_out,
    overlong_penalty,
    shaped_rewards,
)
from orbit.rl.loss import LossStats, Norm, own_norm, policy_loss
from orbit.rl.presets import PRESET_NAMES, PRESETS

__all__ = [
    "AlgorithmConfig",
    "LossStats",
    "MaskBand",
    "Norm",
    "PRESETS",
    "PRESET_NAMES",
    "advantages",
    "call_lengths",
    "carries_signal",
    "left_out",
    "overlong_penalty",
    "own_norm",
    "policy_loss",
    "shaped_rewards",
]
