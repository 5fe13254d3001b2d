"""Chat messages to tokens and back: the model's own chat template, tools in and tool calls out.

Token in, token out. A later call of an episode sends the earlier messages back, the model's replies
among them, re-serialised by the agent (a tool call's JSON re-spaced, text re-encoded). Rendering
them again and re-tokenizing would give other tokens than the ones the model sampled (token drift),
and the trainer would score tokens it never generated. So the tokens of a turn the endpoint answered
are reused exactly as generated, and only what follows them is rendered (`continuation`): the
template's own closing of that reply, the new messages, and the next reply's header.

To find where the reply ends and what the template puts after it, the reply is rendered as a
sentinel (`SENTINEL`): everything after the sentinel's closing is the new messages as this template
renders them after such a reply, whatever the reply's content was.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from jinja2 import TemplateError

SENTINEL = "\u27e6orbit-reply\u27e7"
_TOOL_OPEN, _TOOL_CLOSE = "<tool_call>", "</tool_call>"


class ChatError(ValueError):
    """A request this model cannot serve as asked (the message says what and why): a 400."""


@dataclass(frozen=True)
class Parsed:
    """A reply as the OpenAI API gives it: text, tool calls, and the finish reason."""

    content: str | None
    tool_calls: list[dict]
    finish_reason: str

    def message(self) -> dict:
        out: dict = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


def text_of(content) -> str:
    """A message's content as text (a string, or a list of parts of which the text ones count)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    raise ChatError(
        f"messages: content must be a string or a list of parts, got {type(content).__name__}"
    )


def normal(message: dict) -> tuple:
    """What makes two messages the same turn: role, text, tool calls (name and parsed arguments),
    the tool call a result answers. Fields an SDK adds or drops (refusal, annotations, null content)
    do not count."""
    if not isinstance(message, dict) or "role" not in message:
        raise ChatError(f"messages: each message is an object with a role, got {message!r}"[:200])
    calls = tuple(
        (c.get("function", {}).get("name"), _canonical(c.get("function", {}).get("arguments")))
        for c in message.get("tool_calls") or []
    )
    return (
        message["role"],
        text_of(message.get("content")),
        calls,
        message.get("tool_call_id") or "",
        message.get("name") or "",
    )


def _canonical(arguments) -> str:
    """A tool call's arguments compared by value: JSON however it was spaced."""
    if isinstance(arguments, str):
        try:
            return json.dumps(json.loads(arguments), sort_keys=True)
        except json.JSONDecodeError:
            return arguments
    return json.dumps(arguments, sort_keys=True)


def for_template(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them: text content, tool-call arguments as objects
    (Qwen-style templates write them with tojson)."""
    out = []
    for m in messages:
        msg = {"role": m["role"], "content": text_of(m.get("content"))}
        if m.get("tool_calls"):
            msg["tool_calls"] = [
                {
                    "type": "function",
                    "id": c.get("id"),
                    "function": {
                        "name": c.get("function", {}).get("name"),
                        "arguments": _as_object(c.get("function", {}).get("arguments")),
                    },
                }
                for c in m["tool_calls"]
            ]
        for key in ("tool_call_id", "name"):
            if m.get(key):
                msg[key] = m[key]
        out.append(msg)
    return out


def _as_object(arguments):
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


class Renderer:
    """A tokenizer's chat template, rendered and tokenized the way the endpoint needs it."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        template = tokenizer.chat_template or ""
        if not isinstance(template, str):  # several named templates: the default one
            template = dict(template).get("default", "")
        self.has_template = bool(template)
        self.supports_tools = "tools" in template

    def _render(self, messages: list[dict], tools: list[dict] | None, generation: bool) -> str:
        if not self.has_template:
            raise ChatError("this model's tokenizer has no chat template; use /v1/completions")
        if tools and not self.supports_tools:
            raise ChatError(
                "tools: this model's chat template does not render tools (it never mentions them); "
                "leave tools out, or use a model whose template has tool support"
            )
        try:
            return self.tokenizer.apply_chat_template(
                for_template(messages),
                tools=tools or None,
                tokenize=False,
                add_generation_prompt=generation,
            )
        except TemplateError as err:  # e.g. "Conversation roles must alternate user/assistant/..."
            raise ChatError(f"the model's chat template refused these messages: {err}") from None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The whole conversation rendered, with the header of the reply to generate."""
        return self.encode(self._render(messages, tools, generation=True))

    def continuation(
        self,
        messages: list[dict],
        tools: list[dict] | None,
        reply_at: int,
        generated: list[int],
        stopped: bool,
    ) -> list[int] | None:
        """The tokens that follow the generated tokens of the reply `messages[reply_at]`: the rest
        of the template's closing of that reply (`stopped`: the generation ended on a stop token,
        which may be the closing's start, e.g. <|im_end|>), `messages[reply_at + 1:]` and the next
        reply's header. None when the template renders the messages before the reply differently
        once more follow it (the episode then forks)."""
        probe = [*messages[:reply_at], {"role": "assistant", "content": SENTINEL}]
        full = self._render(probe + list(messages[reply_at + 1 :]), tools, generation=True)
        alone = self._render(probe, tools, generation=False)
        if full.count(SENTINEL) != 1 or alone.count(SENTINEL) != 1:
            return None
        closing = alone[alone.index(SENTINEL) + len(SENTINEL) :]
        after = full[full.index(SENTINEL) + len(SENTINEL) :]
        if (
            not after.startswith(closing)
            or full[: full.index(SENTINEL)] != alone[: alone.index(SENTINEL)]
        ):
            return None
        last = (
            self.tokenizer.decode(generated[-1:], skip_special_tokens=False)
            if stopped and generated
            else ""
        )
        done = len(last) if last and closing.startswith(last) else 0
        return self.encode(closing[done:] + after[len(closing) :])


def parse_reply(text: str, finish_reason: str, tools_given: bool) -> Parsed:
    """The model's reply as the OpenAI API returns it. With tools, Hermes-style calls
    (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as Qwen2.5 and Qwen3 write them)
    become `tool_calls` with finish reason "tool_calls"; a call that does not parse leaves the reply
    as text with the finish reason the generation had (the OpenAI API's behaviour for a malformed
    call)."""
    if not tools_given or _TOOL_OPEN not in text:
        return Parsed(text, [], finish_reason)
    calls, rest, pos = [], text[: text.index(_TOOL_OPEN)], text.index(_TOOL_OPEN)
    while pos >= 0:
        end = text.find(_TOOL_CLOSE, pos)
        if end < 0:
            return Parsed(text, [], finish_reason)
        try:
            call = json.loads(text[pos + len(_TOOL_OPEN) : end].strip())
        except json.JSONDecodeError:
            return Parsed(text, [], finish_reason)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return Parsed(text, [], finish_reason)
        arguments = call.get("arguments", {})
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": call["name"],
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                },
            }
        )
        pos = text.find(_TOOL_OPEN, end)
    return Parsed(rest.strip() or None, calls, "tool_calls")
