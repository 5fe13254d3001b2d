"""Advantage estimators: one reward per sample in, one advantage per sample out, group by group.

Every estimator gives a group whose rewards are all equal exactly zero: it carries no signal, and no
rounding may invent one.
"""

from __future__ import annotations

import math

EPS = 1e-6


def _all_equal(rewards: list[float]) -> bool:
    return len(rewards) < 2 or all(r == rewards[0] for r in rewards)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _sample_std(xs: list[float]) -> float:
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def grpo(rewards: list[float], eps: float = EPS) -> list[float]:
    """GRPO: (r - mean) / (std + eps) within the group (sample std, as TRL's)."""
    if _all_equal(rewards):
        return [0.0] * len(rewards)
    mean, std = _mean(rewards), _sample_std(rewards)
    return [(r - mean) / (std + eps) for r in rewards]


def dr_grpo(rewards: list[float]) -> list[float]:
    """Dr. GRPO: r - mean, no division by the std (which favours groups of nearly equal rewards)."""
    if _all_equal(rewards):
        return [0.0] * len(rewards)
    mean = _mean(rewards)
    return [r - mean for r in rewards]


def rloo(rewards: list[float]) -> list[float]:
    """RLOO: r_i minus the mean of the group's other rewards."""
    n = len(rewards)
    if _all_equal(rewards):
        return [0.0] * n
    total = sum(rewards)
    return [r - (total - r) / (n - 1) for r in rewards]


def batch(groups: list[list[float]], eps: float = EPS) -> list[list[float]]:
    """REINFORCE++ baseline: each group's mean removed, then every value divided by the std of those
    centred values over the whole batch (sample std)."""
    centred = [dr_grpo(g) for g in groups]
    flat = [a for g in centred for a in g]
    if len(flat) < 2 or all(a == 0.0 for a in flat):
        return centred
    std = _sample_std(flat)
    return [[a / (std + eps) for a in g] for g in centred]


def advantages(groups: list[list[float]], estimator: str) -> list[list[float]]:
    """The advantages of a batch's groups, each group its samples' rewards."""
    if estimator == "batch":
        return batch(groups)
    per_group = {"grpo": grpo, "dr_grpo": dr_grpo, "rloo": rloo}[estimator]
    return [per_group(g) for g in groups]
