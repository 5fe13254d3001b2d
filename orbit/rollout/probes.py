"""Staged sampling's probes (`algorithm.screen: k`): a few samples of a prompt, generated to decide
whether the prompt is worth a group, and never trained.

A probe is `k` samples of a new prompt. When they all reached the best reward the run has seen, the
policy already solves the prompt and dynamic sampling would most likely drop its group: the prompt
is dropped there, for `k` samples instead of a group's `n`. Otherwise the prompt waits in `passed`
for admission (pipeline.py), where its group starts whole, `n` fresh samples drawn with seeds of
their own: the group trained is a plain draw from the policy, not one whose first samples are known
to disagree, and its staleness is that of any group. Probes stand outside admission (they are never
trained), so they run while the groups' window is full, and the engine's rows stay full; with the
probe's samples part of the group (the first version), a group took two rounds of generation inside
a window of max_staleness + 1 steps and the engine had a quarter of its rows
(bench/investigations/learning.md).

Probes run only while at least `screen.min_screened` (`algorithm.screen_from`) of the recent prompts
were screened out (a prompt started as a whole group counts as what a probe of its first `k` samples
would have found): until then a probe costs `k` samples a prompt and saves few. Only the overlapped
modes have probes (recipe check): a serial step must end with nothing in flight. A resumed run skips
the prompts probed or passed and not yet started, as it skips groups in flight, and counts its
verdicts afresh. All state here is the pipeline's, read and changed under its lock.
"""

from __future__ import annotations

from collections import deque

from orbit.rollout.groups import Screen
from orbit.tasks.base import Prompt


class Probes:
    def __init__(self, screen: Screen, window: int) -> None:
        """`window`: the groups admission lets start ahead of the trainer ((K + 1) batches); probes
        run until that many prompts have passed or are expected to pass."""
        self.screen, self.window = screen, window
        self.pending = 0  # probes in flight
        self.passed: deque[tuple[int, Prompt]] = deque()  # (group number, prompt), oldest first
        # the recent prompts' verdicts: passed (True) or screened out
        self.verdicts: deque[bool] = deque(maxlen=4 * window)

    @property
    def k(self) -> int:
        return self.screen.k

    def on(self) -> bool:
        """Do new prompts start as probes: were at least `min_screened` of the recent ones screened
        out? (With no verdict yet, only when `min_screened` is 0.)"""
        screened_out = len(self.verdicts) - sum(self.verdicts)
        return screened_out >= self.screen.min_screened * max(len(self.verdicts), 1)

    def wanted(self, grants: int) -> bool:
        """Is another probe worth starting: fewer prompts passed and waiting, or expected to pass
        among the pending probes (at the recent pass rate, counted as if one more had passed), than
        admission's window and the `grants` left (at the end of a run, no group could start)?"""
        rate = (sum(self.verdicts) + 1) / (len(self.verdicts) + 1)
        return len(self.passed) + self.pending * rate < min(self.window, grants)

    def judged(self, passed: bool) -> None:
        self.verdicts.append(passed)
