"""The episodes behind the OpenAI-compatible endpoint (endpoint.py): where each episode's calls go,
how they sample, how their prompts are built (token in, token out: chat.py), and what they record
(record.py).

Every call goes to the episode's engine (its group's) on the episode's slot, the slot of the current
version while training: `submit` is the pool's generate. It samples with the recipe's temperature,
top-p and top-k, whatever the request says (the trainer scores with those; a request that asks
otherwise is recorded as overridden). An aborted generation (a pause, a slot rewritten) is generated
again, at most `max_attempts` times.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import uuid
import zlib
from collections.abc import Callable
from concurrent.futures import Future

from orbit.agents.chat import ChatError, Renderer, normal
from orbit.agents.record import EpisodeRecord, Turn
from orbit.engine.base import Completion, SamplingParams

Submit = Callable[[list[int], SamplingParams, object, "int | None", dict], Future]


class Episodes:
    """The episodes an endpoint serves (endpoint.py is the HTTP around them): `open` one, generate
    and record its calls, `close` it for its record."""

    def __init__(
        self,
        tokenizer,
        submit: Submit,
        model: str,
        max_context: int | None = None,
        max_attempts: int = 8,
        on_completion: Callable[[Completion], None] | None = None,
        on_aborted: Callable[[int], None] | None = None,
    ) -> None:
        self.tokenizer, self.submit, self.model = tokenizer, submit, model
        self.renderer = Renderer(tokenizer)
        self.max_context, self.max_attempts = max_context, max_attempts
        self.on_completion, self.on_aborted = on_completion, on_aborted
        self._episodes: dict[str, EpisodeRecord] = {}
        self._lock = threading.Lock()

    # ---- episodes --------------------------------------------------------------------------------

    def open(
        self,
        engine: int | None,
        slot: object,
        sampling: SamplingParams,
        episode: str | None = None,
        meta: dict | None = None,
    ) -> str:
        eid = episode or uuid.uuid4().hex[:16]
        with self._lock:
            self._episodes[eid] = EpisodeRecord(eid, engine, slot, sampling, meta=dict(meta or {}))
        return eid

    def close(self, episode: str) -> EpisodeRecord:
        """The episode's record; later calls of it are refused."""
        with self._lock:
            return self._episodes.pop(episode)

    def episode(self, episode: str) -> EpisodeRecord | None:
        with self._lock:
            return self._episodes.get(episode)

    # ---- generation ------------------------------------------------------------------------------

    def sampling(
        self, record: EpisodeRecord, request: dict, stop_ids: tuple[int, ...]
    ) -> SamplingParams:
        """The recipe's sampling, capped by the request's max_tokens; what the request asked
        otherwise is recorded as overridden."""
        base = record.sampling
        for key, ours in (("temperature", base.temperature), ("top_p", base.top_p)):
            if request.get(key) is not None and float(request[key]) != ours:
                record.overridden.add(key)
        limit = request.get("max_completion_tokens") or request.get("max_tokens")
        new = min(int(limit), base.max_new_tokens) if limit else base.max_new_tokens
        return dataclasses.replace(
            base,
            max_new_tokens=max(new, 1),
            stop_token_ids=tuple(dict.fromkeys(base.stop_token_ids + stop_ids)),
        )

    async def generate(
        self, record: EpisodeRecord, prompt_ids: list[int], sampling: SamplingParams, n: int
    ) -> tuple[int, list[Completion]]:
        """The call's number in the episode, and `n` completions of the prompt on the episode's
        engine and slot (aborted ones generated again). A call that fails is remembered on the
        record: an episode lost with no turn says why its calls failed."""
        try:
            if self.max_context is not None:
                room = self.max_context - len(prompt_ids) - 1
                if room < 1:
                    raise ChatError(
                        f"the prompt is {len(prompt_ids)} tokens; the engine's context is "
                        f"{self.max_context} (engine.max_context)"
                    )
                sampling = dataclasses.replace(
                    sampling, max_new_tokens=min(sampling.max_new_tokens, room)
                )
            with record.lock:
                call = record.calls
                record.calls += 1
            return call, list(
                await asyncio.gather(
                    *(self._one(record, prompt_ids, sampling, call, i) for i in range(n))
                )
            )
        except Exception as err:
            record.failed = f"{type(err).__name__}: {err}"
            raise

    async def _one(
        self,
        record: EpisodeRecord,
        prompt_ids: list[int],
        sampling: SamplingParams,
        call: int,
        choice: int,
    ) -> Completion:
        for attempt in range(self.max_attempts):
            # the same seed in every run (no str hash)
            key = f"{record.id}/{call}/{choice}/{attempt}".encode()
            seeded = dataclasses.replace(sampling, seed=zlib.crc32(key) & 0x7FFFFFFF)
            fut = self.submit(prompt_ids, seeded, record.slot, record.engine, record.meta)
            completion: Completion = await asyncio.wrap_future(fut)
            record.engine = completion.engine  # the pool may have moved it off a dead engine
            if self.on_completion is not None:
                self.on_completion(completion)
            if completion.finish_reason != "abort":
                return completion
            record.aborted_tokens += len(completion.output_ids)
            if self.on_aborted is not None:
                self.on_aborted(len(completion.output_ids))
        raise ChatError(
            f"the generation was aborted {self.max_attempts} times (rollout.max_attempts)"
        )

    def record_turn(
        self,
        record: EpisodeRecord,
        call: int,
        prompt_ids: list[int],
        completion: Completion,
        reply: tuple | None = None,
        messages: tuple = (),
        text: str | None = None,
    ) -> None:
        """A turn, linked to the turn its prompt continues; a fork when it continues none."""
        with record.lock:
            parent = record.parent_of(prompt_ids)
            # (the n choices of one call share their prompt: they are not forks of each other)
            if parent is None and any(t.call != call for t in record.turns):
                record.forks.append(
                    f"call {call}: its prompt continues no earlier turn (the history was edited, "
                    "or the conversation started over)"
                )
            record.turns.append(
                Turn(call, list(prompt_ids), completion, parent, reply, messages, text)
            )

    # ---- stop strings ----------------------------------------------------------------------------

    def stops(self, stop) -> tuple[tuple[int, ...], list[str]]:
        """Stop strings of one token become stop tokens; longer ones are cut after generation."""
        if stop is None:
            return (), []
        strings = [stop] if isinstance(stop, str) else list(stop)
        if not all(isinstance(s, str) and s for s in strings):
            raise ChatError("stop: a string or a list of non-empty strings")
        ids, cut = [], []
        for s in strings:
            encoded = self.tokenizer.encode(s, add_special_tokens=False)
            (ids.append(encoded[0]) if len(encoded) == 1 else cut.append(s))
        return tuple(ids), cut

    def cut(self, completion: Completion, strings: list[str]) -> tuple[Completion, int | None]:
        """The completion ending with the token that completes the first stop string (a prefix of
        what was sampled, so the tokens stay exactly the sampled ones), and where that string starts
        in its text."""
        if not strings:
            return completion, None
        text = self.tokenizer.decode(completion.output_ids, skip_special_tokens=True)
        if not any(s in text for s in strings):
            return completion, None
        # The shortest prefix whose text holds a stop string: found by bisection, as a prefix that
        # holds one stays holding it (each decode is of one prefix; trying every prefix would be
        # quadratic).
        low, high = 1, len(completion.output_ids)
        while low < high:
            mid = (low + high) // 2
            part = self.tokenizer.decode(completion.output_ids[:mid], skip_special_tokens=True)
            low, high = (low, mid) if any(s in part for s in strings) else (mid + 1, high)
        part = self.tokenizer.decode(completion.output_ids[:low], skip_special_tokens=True)
        return dataclasses.replace(
            completion,
            output_ids=completion.output_ids[:low],
            logprobs=completion.logprobs[:low],
            finish_reason="stop",
        ), min(part.index(s) for s in strings if s in part)

    def text(self, completion: Completion, at: int | None = None) -> str:
        """What the caller reads: the tokens as text, special tokens (the end of turn) left out, a
        stop string and what follows left out."""
        text = self.tokenizer.decode(completion.output_ids, skip_special_tokens=True)
        return text if at is None else text[:at]

    def logprobs(self, completion: Completion) -> dict:
        """The OpenAI logprobs object: each token's text, logprob and bytes (top_logprobs are not
        kept)."""
        content = []
        for tok, lp in zip(completion.output_ids, completion.logprobs, strict=True):
            piece = self.tokenizer.decode([tok], skip_special_tokens=False)
            content.append(
                {"token": piece, "logprob": lp, "bytes": list(piece.encode()), "top_logprobs": []}
            )
        return {"content": content}


def messages_prompt(
    endpoint: Episodes, record: EpisodeRecord, messages: list[dict], tools: list[dict] | None
) -> tuple[list[int], tuple]:
    """The prompt's token ids for a chat call: an earlier reply sent back is continued from its own
    tokens (chat.py); otherwise the whole conversation rendered (the episode's first call, or a
    fork)."""
    normalised = tuple(normal(m) for m in messages)
    with record.lock:
        found = record.reply_turn(list(normalised))
    if found is not None:
        turn = record.turns[found[0]]
        rest = endpoint.renderer.continuation(
            messages,
            tools,
            found[1],
            turn.completion.output_ids,
            stopped=turn.completion.finish_reason == "stop",
        )
        if rest is not None:
            return turn.full_ids + rest, normalised
    return endpoint.renderer.prompt(messages, tools), normalised
