"""What happens to rewards and samples before the loss: DAPO's overlong penalty, the completions cut
by the length limit left out, and the groups that carry no signal.

Lengths count the tokens the model generated (a multi-turn episode's tool tokens are not its own).
"""

from __future__ import annotations

from orbit.rl.config import AlgorithmConfig


def overlong_penalty(length: int, max_new_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment: 0 up to max_new_tokens - buffer tokens, then falling
    linearly to -1 at max_new_tokens, and -1 past it."""
    start = max_new_tokens - buffer
    if length <= start:
        return 0.0
    if length <= max_new_tokens:
        return (start - length) / buffer
    return -1.0


def shaped_rewards(
    rewards: list[float], lengths: list[int], cfg: AlgorithmConfig, max_new_tokens: int
) -> list[float]:
    """The rewards the advantages are computed from: the task's, plus the overlong penalty when it
    is on."""
    if cfg.overlong != "penalty":
        return list(rewards)
    buffer = cfg.buffer(max_new_tokens)
    return [
        r + overlong_penalty(n, max_new_tokens, buffer)
        for r, n in zip(rewards, lengths, strict=True)
    ]


def carries_signal(rewards: list[float]) -> bool:
    """False for a group whose rewards are all equal: its advantages are all zero."""
    return any(r != rewards[0] for r in rewards)


def left_out(finish_reasons: list[str], cfg: AlgorithmConfig) -> list[bool]:
    """Which samples the loss leaves out: with overlong: mask, those cut by the length limit."""
    return [cfg.overlong == "mask" and f == "length" for f in finish_reasons]
