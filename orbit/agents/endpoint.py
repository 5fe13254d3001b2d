"""An OpenAI-compatible endpoint in front of the engines, recording every token of every episode.

Each episode gets its own base URL, `http://127.0.0.1:PORT/e/EPISODE/v1`: an agent's `openai` client
pointed there makes calls that Orbit knows the episode of. The routes (FastAPI, served by uvicorn on
a thread):
- `POST .../v1/chat/completions`: messages rendered with the model's chat template (token in, token
  out:
  chat.py), `tools` and Hermes-style tool calls, `n`, `stop`, `max_tokens`, `logprobs`; `stream`
  refused;
- `POST .../v1/completions`: a text prompt (continuing an earlier call's text reuses its tokens) or
  token ids;
- `GET .../v1/models`;
- `POST .../inference/v1/generate`: token ids in, token ids and logprobs out (vLLM-style, as
  `verifiers` posts).

How each call is generated and recorded is episodes.py's. Errors come back as the OpenAI API's
`{"error": {"message", "type", "param", "code"}}`: 400 for a request this model cannot serve as
asked, 404 for an episode that is not open (the endpoint serves the run's episodes only).
"""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from orbit.agents.chat import ChatError, normal, parse_reply
from orbit.agents.episodes import Episodes, messages_prompt
from orbit.agents.record import EpisodeRecord
from orbit.engine.base import EngineError
from orbit.host.net import ThreadServer


class EndpointError(RuntimeError):
    """The endpoint could not start (the message says why)."""


class Endpoint(Episodes):
    """The episodes, served: `start` it, give each episode's agent `base_url(id)`, `stop` it."""

    def __init__(self, *args, host: str = "127.0.0.1", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.host, self.port = host, 0
        self._server: ThreadServer | None = None

    def start(self, port: int | None = None) -> Endpoint:
        try:
            self._server = ThreadServer(
                app_for(self), self.host, port, name="orbit-endpoint"
            ).start()
        except OSError as err:
            raise EndpointError(f"the episode endpoint did not start: {err}") from None
        self.port = self._server.port
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()

    def __enter__(self) -> Endpoint:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def base_url(self, episode: str) -> str:
        """What an episode's `openai` client is given."""
        return f"{self.url}/e/{episode}/v1"


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": None}},
        status_code=status,
    )


class _NoEpisode(Exception):
    pass


def app_for(endpoint: Episodes) -> FastAPI:
    app = FastAPI(title="orbit episode endpoint", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ChatError)
    async def _bad(_: Request, err: ChatError) -> JSONResponse:
        return _error(400, str(err))

    @app.exception_handler(_NoEpisode)
    async def _gone(_: Request, err: _NoEpisode) -> JSONResponse:
        return _error(404, str(err), "not_found_error")

    @app.exception_handler(EngineError)
    # the run stops, saying why; the agent sees why
    async def _engine(_: Request, err: EngineError) -> JSONResponse:
        return _error(503, f"the engine could not generate: {err}", "service_unavailable_error")

    @app.exception_handler(ValueError)
    # a request field of the wrong kind
    async def _value(_: Request, err: ValueError) -> JSONResponse:
        return _error(400, f"{type(err).__name__}: {err}")

    @app.exception_handler(Exception)
    async def _bug(_: Request, err: Exception) -> JSONResponse:
        # Orbit's own failure: the agent's error (and so the lost episode's reason) says what it
        # was.
        return _error(500, f"Orbit's endpoint failed: {type(err).__name__}: {err}", "server_error")

    def episode(eid: str) -> EpisodeRecord:
        record = endpoint.episode(eid)
        if record is None:
            raise _NoEpisode(
                f"no open episode {eid!r}: this endpoint serves the run's episodes, each at the "
                "base URL Orbit gives its agent (.../e/EPISODE/v1)"
            )
        return record

    async def body(request: Request) -> dict:
        try:
            data = await request.json()
        except ValueError:
            raise ChatError("the request body is not JSON") from None
        if not isinstance(data, dict):
            raise ChatError("the request body must be a JSON object")
        if data.get("stream"):
            raise ChatError(
                "stream: streaming is not supported by Orbit's endpoint; ask without stream"
            )
        n = data.get("n") or 1
        if not isinstance(n, int) or not 1 <= n <= 64:
            raise ChatError(f"n: an integer from 1 to 64, got {n!r}")
        return data

    def usage(prompt: int, completions) -> dict:
        out = sum(len(c.output_ids) for c in completions)
        return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out}

    @app.get("/v1/models")
    @app.get("/e/{eid}/v1/models")
    async def models(eid: str | None = None) -> dict:
        return {
            "object": "list",
            "data": [{"id": endpoint.model, "object": "model", "created": 0, "owned_by": "orbit"}],
        }

    @app.post("/e/{eid}/v1/chat/completions")
    async def chat(eid: str, request: Request) -> dict:
        record, data = episode(eid), await body(request)
        messages, tools = data.get("messages"), data.get("tools") or None
        if not isinstance(messages, list) or not messages:
            raise ChatError("messages: a non-empty list of messages")
        stop_ids, cut = endpoint.stops(data.get("stop"))
        prompt_ids, normalised = messages_prompt(endpoint, record, messages, tools)
        call, completions = await endpoint.generate(
            record, prompt_ids, endpoint.sampling(record, data, stop_ids), data.get("n") or 1
        )
        choices = []
        for i, completion in enumerate(completions):
            completion, at = endpoint.cut(completion, cut)
            parsed = parse_reply(
                endpoint.text(completion, at), completion.finish_reason, bool(tools)
            )
            message = parsed.message()
            endpoint.record_turn(record, call, prompt_ids, completion, normal(message), normalised)
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "finish_reason": parsed.finish_reason,
                    "logprobs": endpoint.logprobs(completion) if data.get("logprobs") else None,
                }
            )
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": endpoint.model,
            "choices": choices,
            "usage": usage(len(prompt_ids), completions),
        }

    @app.post("/e/{eid}/v1/completions")
    async def completions(eid: str, request: Request) -> dict:
        record, data = episode(eid), await body(request)
        prompt = data.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt_ids = list(prompt)
        elif isinstance(prompt, str) and prompt:
            prompt_ids = text_prompt(endpoint, record, prompt)
        else:
            raise ChatError("prompt: a non-empty string or a list of token ids")
        stop_ids, cut = endpoint.stops(data.get("stop"))
        call, done = await endpoint.generate(
            record, prompt_ids, endpoint.sampling(record, data, stop_ids), data.get("n") or 1
        )
        choices = []
        for i, completion in enumerate(done):
            completion, at = endpoint.cut(completion, cut)
            text = endpoint.text(completion, at)
            endpoint.record_turn(
                record,
                call,
                prompt_ids,
                completion,
                text=(prompt + text) if isinstance(prompt, str) else None,
            )
            lp = (
                endpoint.logprobs(completion)["content"]
                if data.get("logprobs") is not None
                else None
            )
            choices.append(
                {
                    "index": i,
                    "text": text,
                    "finish_reason": completion.finish_reason,
                    "logprobs": None
                    if lp is None
                    else {
                        "tokens": [c["token"] for c in lp],
                        "token_logprobs": [c["logprob"] for c in lp],
                        "top_logprobs": None,
                        "text_offset": None,
                    },
                }
            )
        return {
            "id": f"cmpl-{uuid.uuid4().hex[:24]}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": endpoint.model,
            "choices": choices,
            "usage": usage(len(prompt_ids), done),
        }

    @app.post("/e/{eid}/inference/v1/generate")
    # a client that joins the path to the base URL it was given
    @app.post("/e/{eid}/v1/inference/v1/generate")
    async def generate(eid: str, request: Request) -> dict:
        """Token in, token out (vLLM-style, as `verifiers` posts): `token_ids` and
        `sampling_params`."""
        record, data = episode(eid), await body(request)
        prompt_ids = data.get("token_ids") or data.get("prompt_token_ids")
        if (
            not isinstance(prompt_ids, list)
            or not prompt_ids
            or not all(isinstance(t, int) for t in prompt_ids)
        ):
            raise ChatError("token_ids: a non-empty list of token ids")
        params = data.get("sampling_params") or {}
        n = params.get("n") or 1
        if not isinstance(n, int) or not 1 <= n <= 64:
            raise ChatError(f"sampling_params.n: an integer from 1 to 64, got {n!r}")
        stop_ids, cut = endpoint.stops(params.get("stop"))
        call, done = await endpoint.generate(
            record, prompt_ids, endpoint.sampling(record, params, stop_ids), n
        )
        choices = []
        for i, completion in enumerate(done):
            completion, at = endpoint.cut(completion, cut)
            endpoint.record_turn(record, call, prompt_ids, completion)
            choices.append(
                {
                    "index": i,
                    "token_ids": completion.output_ids,
                    "text": endpoint.text(completion, at),
                    "finish_reason": completion.finish_reason,
                    "logprobs": {
                        "content": [
                            {"token": f"token_id:{t}", "logprob": lp}
                            for t, lp in zip(
                                completion.output_ids, completion.logprobs, strict=True
                            )
                        ]
                    },
                }
            )
        return {
            "id": f"gen-{uuid.uuid4().hex[:24]}",
            "choices": choices,
            "usage": usage(len(prompt_ids), done),
        }

    return app


def text_prompt(endpoint: Episodes, record: EpisodeRecord, prompt: str) -> list[int]:
    """A text prompt's ids: when it continues the text of an earlier completion call (its prompt and
    the text returned), that call's tokens and only the rest tokenized (token in, token out)."""
    with record.lock:
        for turn in reversed(record.turns):
            if (
                turn.text is not None
                and len(turn.text) < len(prompt)
                and prompt.startswith(turn.text)
            ):
                return turn.full_ids + endpoint.renderer.encode(prompt[len(turn.text) :])
    # a first prompt: with the tokenizer's BOS, if any
    return list(endpoint.tokenizer(prompt)["input_ids"])
