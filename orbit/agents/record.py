"""What an episode's calls recorded, and the trajectory the trainer learns from.

Every answered choice of every call is a `Turn`: the prompt's token ids, the generated ids with the
engine's logprobs, the adapter version that made them, the finish reason, and the turn it continues.
A turn continues another when its prompt is that turn's prompt and generated tokens followed by more
(tokens of a tool result, of the user, of the template): the endpoint builds prompts that way
whenever a call sends an earlier reply back unchanged (chat.py). A call whose prompt continues no
turn of the episode, while the episode has turns, is a fork: the agent edited its history, or
started over.

The trajectory trained is the chain of turns that ends at the episode's last turn: the first prompt,
then each turn's generated tokens (trained, loss_mask 1, their engine logprobs) and the tokens
between them (prompt, tool, user: loss_mask 0). Turns off that chain are recorded and not trained.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from orbit.engine.base import Completion, SamplingParams


@dataclass
class Turn:
    """One answered choice of one call."""

    call: int  # the call's number in the episode
    prompt_ids: list[int]
    completion: Completion
    parent: int | None  # the index of the turn this one continues (None: a root)
    # chat: the reply as returned (chat.normal), to recognise it when sent back
    reply: tuple | None = None
    messages: tuple = ()  # chat: the call's messages (chat.normal), this turn's context
    # completions: the prompt's text and the text returned, to recognise it continued
    text: str | None = None

    @property
    def full_ids(self) -> list[int]:
        return self.prompt_ids + self.completion.output_ids


@dataclass
class EpisodeRecord:
    """One episode: where its calls go, how they sample, and what they recorded."""

    id: str
    engine: int | None  # the engine its group runs on (a group stays on one engine)
    slot: object  # ACTIVE while training; a fixed slot (None: the base) in `orbit eval`
    sampling: SamplingParams  # the recipe's: the trainer scores with these
    # goes with every request (its group, for the timeline)
    meta: dict = field(default_factory=dict)
    turns: list[Turn] = field(default_factory=list)
    calls: int = 0
    forks: list[str] = field(default_factory=list)  # why each fork happened
    # request fields the recipe's sampling replaced
    overridden: set[str] = field(default_factory=set)
    aborted_tokens: int = 0
    failed: str | None = None  # why its last failed call failed
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def parent_of(self, prompt_ids: list[int]) -> int | None:
        """The latest turn whose prompt and generated tokens begin `prompt_ids` (and are not all of
        it)."""
        for i in range(len(self.turns) - 1, -1, -1):
            full = self.turns[i].full_ids
            if len(full) < len(prompt_ids) and prompt_ids[: len(full)] == full:
                return i
        return None

    def reply_turn(self, messages: list[tuple]) -> tuple[int, int] | None:
        """(turn, index in `messages`) of the latest recorded reply that `messages` send back after
        exactly the context it was generated in: the longest such prefix."""
        best = None
        for i, turn in enumerate(self.turns):
            if turn.reply is None:
                continue
            n = len(turn.messages)
            if (
                n < len(messages) - 1
                and tuple(messages[:n]) == turn.messages
                and messages[n] == turn.reply
            ):
                if best is None or n >= best[1]:
                    best = (i, n)
        return best


@dataclass
class Trajectory:
    """The chain of turns an episode trains on, read as a multi-turn Completion
    (orbit/rollout/groups.py)."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    loss_mask: list[int]
    # per output token: the adapter version that generated it (-1: not generated, or unknown)
    versions: list[int]
    version_start: int
    version_end: int
    finish_reason: str
    turns: int
    tool_results: int  # stretches of tokens between turns (tool results, user messages)
    slot: int | None
    t_start: float
    t_end: float
    engine: int = 0


def trajectory(record: EpisodeRecord) -> Trajectory | None:
    """The chain ending at the episode's last turn, or None when the episode made no call."""
    if not record.turns:
        return None
    chain = []
    i: int | None = len(record.turns) - 1
    while i is not None:
        chain.append(record.turns[i])
        i = record.turns[i].parent
    chain.reverse()
    out, logprobs, mask, versions = [], [], [], []
    between = 0
    full = list(chain[0].prompt_ids)
    for turn in chain:
        extra = turn.prompt_ids[len(full) :]
        if extra:
            between += 1
        c = turn.completion
        out += extra + c.output_ids
        logprobs += [0.0] * len(extra) + list(c.logprobs)
        mask += [0] * len(extra) + [1] * len(c.output_ids)
        versions += [-1] * len(extra) + [c.token_version] * len(c.output_ids)
        full = turn.full_ids
    first, last = chain[0].completion, chain[-1].completion
    return Trajectory(
        prompt_ids=list(chain[0].prompt_ids),
        output_ids=out,
        logprobs=logprobs,
        loss_mask=mask,
        versions=versions,
        # staleness from the oldest token
        version_start=min(t.completion.version_start for t in chain),
        version_end=max(t.completion.version_end for t in chain),
        finish_reason=last.finish_reason,
        turns=len(chain),
        tool_results=between,
        slot=last.slot,
        t_start=first.t_start,
        t_end=last.t_end,
        engine=last.engine,
    )
