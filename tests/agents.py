"""Agents written only against the `openai` client, as a user writes them: the agent tests' tasks
(`task: {name: agent, entry: tests/agents.py:FUNCTION, data: ...}`)."""

from __future__ import annotations

import asyncio
import itertools
import math

_episodes = itertools.count()


def _says_yes(text: str | None) -> float:
    """The share of the reply's text that is "yes": a reward the tiny model learns in a few dozen
    steps."""
    text = text or ""
    return 3 * text.lower().count("yes") / max(len(text), 3)


async def retry(client, model: str, example: dict) -> tuple[float, dict]:
    """Ask; while the answer is wrong, say so and ask again (at most twice more); 1 for a right
    final answer."""
    messages = [{"role": "user", "content": example["question"]}]
    for attempt in range(3):
        reply = await client.chat.completions.create(model=model, messages=messages)
        text = reply.choices[0].message.content or ""
        if example["answer"] in text.split():
            return 1.0, {"attempts": attempt + 1}
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": "That is wrong, try again."},
        ]
    return 0.0, {"attempts": 3}


async def yes(client, model: str, example: dict) -> float:
    """Two turns; the reward is how much of the replies say "yes"."""
    messages = [{"role": "user", "content": f"say yes: {example['question']}"}]
    reply = await client.chat.completions.create(model=model, messages=messages)
    messages += [
        reply.choices[0].message.model_dump(exclude_none=True),
        {"role": "user", "content": "Again?"},
    ]
    again = await client.chat.completions.create(model=model, messages=messages)
    return (
        _says_yes(reply.choices[0].message.content) + _says_yes(again.choices[0].message.content)
    ) / 2


async def flaky(client, model: str, example: dict) -> float:
    """`yes`, but one episode in 9 raises, one hangs and one returns NaN."""
    n = next(_episodes) % 9
    reward = await yes(client, model, example)
    if n == 1:
        raise ValueError(f"the agent's own bug (episode {n})")
    if n == 4:
        await asyncio.sleep(3600)
    if n == 7:
        return math.nan
    return reward


async def broken(client, model: str, example: dict) -> float:
    """Every episode raises: the run must stop, saying so."""
    await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    raise RuntimeError("this agent always fails")


def not_async(client, model, example):
    return 1.0
