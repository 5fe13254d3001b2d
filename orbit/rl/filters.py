"""What happens to rewards and samples before the loss: DAPO's overlong penalty, the completions cut
by the length limit left out, and the groups that carry no signal.

Lengths count the tokens the model generated in one call (a multi-turn episode's tool tokens are not
its own, and each of its calls had its own `max_new_tokens`).
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


def call_lengths(loss_mask: list[int]) -> list[int]:
    """The tokens the model generated in each of its calls: the runs of 1s in a sample's loss mask
    (a multi-turn episode's calls are separated by the tokens injected between them, mask 0)."""
    runs, n = [], 0
    for m in loss_mask:
        if m:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs + [n] if n else runs


def shaped_rewards(
    rewards: list[float], calls: list[list[int]], cfg: AlgorithmConfig, max_new_tokens: int
) -> list[float]:
    """The rewards the advantages are computed from: the task's, plus the overlong penalty when it
    is on. `calls[i]` is sample i's call lengths (`call_lengths`). DAPO's penalty is on one response
    against its length limit; an episode of several calls, each limited to `max_new_tokens`, takes
    its longest call's penalty (not its calls' sum against one call's limit, which would charge a
    second attempt as an answer cut short)."""
    if cfg.overlong != "penalty":
        return list(rewards)
    buffer = cfg.buffer(max_new_tokens)
    return [
        r + min((overlong_penalty(n, max_new_tokens, buffer) for n in ns), default=0.0)
        for r, ns in zip(rewards, calls, strict=True)
    ]


def carries_signal(rewards: list[float]) -> bool:
    """False for a group whose rewards are all equal: its advantages are all zero."""
    return any(r != rewards[0] for r in rewards)


def left_out(finish_reasons: list[str], cfg: AlgorithmConfig) -> list[bool]:
    """Which samples the loss leaves out: with overlong: mask, those cut by the length limit."""
    return [cfg.overlong == "mask" and f == "length" for f in finish_reasons]
