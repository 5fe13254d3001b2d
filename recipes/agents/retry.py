"""An agent written only against the `openai` client: it asks a question, and while the answer is wrong it
says so and asks again, at most twice more. 1 for a right final answer, 0 otherwise.

    task: {name: agent, entry: recipes/agents/retry.py:solve, data: recipes/data/add-2digit.jsonl}

Nothing here knows Orbit: point `client` at any OpenAI-compatible server and it runs the same.
"""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d[\d,]*")
ATTEMPTS = 3


def final_number(text: str) -> str | None:
    """The last number the reply gives (thousands commas dropped), or None."""
    found = NUMBER.findall(text or "")
    return found[-1].replace(",", "") if found else None


async def solve(client, model: str, example: dict) -> tuple[float, dict]:
    messages = [{"role": "user", "content": example["question"]}]
    for attempt in range(1, ATTEMPTS + 1):
        reply = await client.chat.completions.create(model=model, messages=messages)
        text = reply.choices[0].message.content or ""
        if final_number(text) == example["answer"]:
            return 1.0, {"attempts": attempt}
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": "That is wrong, try again."}]
    return 0.0, {"attempts": ATTEMPTS}
