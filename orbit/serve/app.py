"""The Tinker HTTP API, as the `tinker` SDK 0.38 speaks it (docs/tinker.md has the table of calls):
JSON everywhere but forward_backward's request and the results of forward_backward and asample,
which are protocol buffers (wire.py). Mutating calls answer a request id at once; `retrieve_future`
waits for the result (futures.py).

A request Orbit refuses gets a 4xx with a JSON body naming what was wrong (the SDK treats an empty
4xx as a proxy's hiccup and retries it); a failure inside a future answers `{"error", "category"}`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError

from orbit.engine.base import SamplingParams
from orbit.serve import wire
from orbit.serve.checkpoints import rest_checkpoint
from orbit.serve.clients import AdamParams, LoraSpec
from orbit.serve.futures import Busy, Gone, NotFound, Record, Refused, RequestFailed, result_of
from orbit.serve.keys import Keys
from orbit.serve.samplers import Stops
from orbit.serve.service import Service

PROTO = "application/x-protobuf"
MAX_BODY = 64 * 2**20  # bytes a request may carry (the SDK cuts a forward_backward at ~5 MB)
OPEN = {"/api/v1/healthz"}  # answered without a key


class TooLarge(Refused):
    """A request body past the limit (HTTP 413)."""


class Unauthorized(Refused):
    """No key, or one the service does not take (HTTP 401)."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class LoraConfig(BaseModel):
    """Every field is honoured; one Orbit does not know is refused, never ignored."""

    model_config = ConfigDict(extra="forbid")
    rank: int = 32
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


class CreateModel(_Body):
    session_id: str
    model_seq_id: int
    base_model: str
    lora_config: LoraConfig = LoraConfig()
    user_metadata: dict[str, Any] | None = None
    optimizer_config: dict[str, Any] | None = None


class Adam(_Body):
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class OptimStep(_Body):
    model_id: str
    seq_id: int = 0
    adam_params: Adam | None = None


class SaveWeights(_Body):
    model_id: str
    path: str
    seq_id: int = 0
    overwrite: bool = False


class SaveForSampler(_Body):
    model_id: str
    seq_id: int = 0
    path: str | None = None
    sampling_session_seq_id: int | None = None
    kind: Literal["snapshot", "inflight"] = "snapshot"


class LoadWeights(_Body):
    path: str
    optimizer: bool = False
    model_id: str | None = None
    seq_id: int = 0
    session_id: str | None = None
    model_seq_id: int | None = None


class CreateSampler(_Body):
    session_id: str
    sampling_session_seq_id: int
    model_path: str | None = None
    base_model: str | None = None


class Chunk(_Body):
    type: str = "encoded_text"
    tokens: list[int] = []


class Prompt(_Body):
    chunks: list[Chunk]


class Sampling(_Body):
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class Sample(_Body):
    sampling_session_id: str
    prompt: Prompt
    sampling_params: Sampling = Sampling()
    num_samples: int = 1
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None


def app(service: Service, keys: Keys = Keys(), max_body: int = MAX_BODY) -> FastAPI:
    """The routes over `service`. `keys`: the API keys it takes (none: any key, one tenant)."""
    api = FastAPI(title="orbit serve: the Tinker API")
    status = {Gone: 410, NotFound: 404, Busy: 429, TooLarge: 413, Unauthorized: 401}

    @api.exception_handler(Refused)
    async def refused(request: Request, err: Refused) -> JSONResponse:
        code = next((c for kind, c in status.items() if isinstance(err, kind)), 400)
        # a refusal the SDK would retry (429) is said at once: it is the limit, not a hiccup
        headers = {"x-should-retry": "false"} if code == 429 else None
        return JSONResponse({"detail": str(err)}, status_code=code, headers=headers)

    @api.exception_handler(ValidationError)
    async def invalid(request: Request, err: ValidationError) -> JSONResponse:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        return JSONResponse({"detail": f"{where}: {first['msg']}"}, status_code=400)

    @api.middleware("http")
    async def tenant(request: Request, call_next: Any) -> Response:
        """Every route but the health check needs a key the service takes; the tenant it names goes
        with the request. A body past the limit is refused before it is read."""
        if request.url.path not in OPEN:
            found = keys.tenant(request.headers.get("x-api-key"))
            if found is None:
                why = "a key this orbit serve takes" if request.headers.get("x-api-key") else "one"
                return JSONResponse(
                    {"detail": f"X-API-Key: {why} is required"},
                    status_code=401,
                    headers={"x-should-retry": "false"},
                )
            request.state.tenant = found
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body:
            return JSONResponse(
                {"detail": f"the body is {int(length)} bytes; at most {max_body} are taken"},
                status_code=413,
            )
        return await call_next(request)

    def who(request: Request) -> str:
        return str(request.state.tenant)

    async def raw(request: Request) -> bytes:
        data = await request.body()
        if len(data) > max_body:
            raise TooLarge(f"the body is {len(data)} bytes; at most {max_body} are taken")
        return data

    async def fields(request: Request) -> dict[str, Any]:
        try:
            data = json.loads(await raw(request) or b"{}")
        except ValueError:
            raise Refused(f"{request.url.path}: the body is not JSON") from None
        if not isinstance(data, dict):
            raise Refused(f"{request.url.path}: the body is not a JSON object")
        return data

    async def body(request: Request, model: type[_Body]) -> Any:
        return model.model_validate(await fields(request))

    def future(record: Record) -> dict[str, Any]:
        return {"request_id": record.id}

    v1 = "/api/v1"

    @api.post(f"{v1}/client/config")
    async def client_config() -> dict[str, Any]:
        # a forward_backward's chunks one after another, as every other request: then a request's
        # arrival means each number below it arrived or never will (training.py)
        return {"parallel_fwdbwd_chunks": False}

    @api.post(f"{v1}/create_session")
    async def create_session(request: Request) -> dict[str, Any]:
        metadata = (await fields(request)).get("user_metadata") or {}
        if not isinstance(metadata, dict):
            raise Refused("user_metadata: not a JSON object")
        session = service.create_session(who(request), metadata)
        return {"session_id": session, "type": "create_session"}

    @api.post(f"{v1}/session_heartbeat")
    async def heartbeat(request: Request) -> dict[str, Any]:
        data = await fields(request)
        service.heartbeat(who(request), str(data.get("session_id", "")))
        return {}

    @api.post(v1 + "/sessions/{session}/finish")
    async def finish(session: str, request: Request) -> dict[str, Any]:
        data = await fields(request)
        reason = data.get("reason")
        kind = reason.get("type", "no reason") if isinstance(reason, dict) else "no reason"
        why = f"finished by its client ({str(kind)[:40]})"
        service.finish_session(who(request), session, why)
        return {}

    @api.post(f"{v1}/unload_model")
    async def unload_model(request: Request) -> dict[str, Any]:
        data = await fields(request)
        return future(service.unload_model(who(request), str(data.get("model_id", ""))))

    @api.post(f"{v1}/telemetry")
    async def telemetry() -> dict[str, Any]:
        return {"status": "accepted"}

    @api.get(f"{v1}/healthz")
    async def health() -> dict[str, Any]:
        return {"status": "ok"}

    @api.post(f"{v1}/create_model")
    async def create_model(request: Request) -> dict[str, Any]:
        req: CreateModel = await body(request, CreateModel)
        lora = req.lora_config
        optimizer = (req.optimizer_config or {}).get("type", "adamw")
        if optimizer != "adamw":
            raise Refused(f"optimizer_config.type: {optimizer!r}; Orbit trains with adamw")
        if not 1 <= lora.rank <= 1024:
            raise Refused(f"lora_config.rank: {lora.rank}; from 1 to 1024")
        if not (lora.train_attn or lora.train_mlp or lora.train_unembed):
            raise Refused("lora_config: train_attn, train_mlp and train_unembed are all false")
        spec = LoraSpec(lora.rank, lora.seed, lora.train_attn, lora.train_mlp, lora.train_unembed)
        record = service.create_model(
            who(request),
            req.session_id,
            req.model_seq_id,
            req.base_model,
            spec,
            req.user_metadata or {},
        )
        return future(record)

    @api.post(f"{v1}/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        data = await fields(request)
        return service.info(who(request), str(data.get("model_id", "")))

    @api.post(f"{v1}/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        data = await raw(request)
        if "zstd" in request.headers.get("content-encoding", ""):
            data = wire.unzstd(data, MAX_BODY)
        return future(service.forward_backward(who(request), wire.forward_backward(data)))

    @api.post(f"{v1}/optim_step")
    async def optim_step(request: Request) -> dict[str, Any]:
        req: OptimStep = await body(request, OptimStep)
        adam = AdamParams(**(req.adam_params or Adam()).model_dump())
        return future(service.optim_step(who(request), req.model_id, req.seq_id, adam))

    @api.post(f"{v1}/save_weights")
    async def save_weights(request: Request) -> dict[str, Any]:
        req: SaveWeights = await body(request, SaveWeights)
        record = service.save_state(who(request), req.model_id, req.seq_id, req.path, req.overwrite)
        return future(record)

    @api.post(f"{v1}/save_weights_for_sampler")
    async def save_for_sampler(request: Request) -> dict[str, Any]:
        req: SaveForSampler = await body(request, SaveForSampler)
        record = service.save_for_sampler(
            who(request),
            req.model_id,
            req.seq_id,
            req.path,
            req.sampling_session_seq_id,
            req.kind,
        )
        return future(record)

    @api.post(f"{v1}/load_weights")
    async def load_weights(request: Request) -> dict[str, Any]:
        req: LoadWeights = await body(request, LoadWeights)
        record = service.load_state(
            who(request),
            req.path,
            req.optimizer,
            req.model_id,
            req.seq_id,
            req.session_id,
            req.model_seq_id,
        )
        return future(record)

    @api.post(f"{v1}/create_sampling_session")
    async def create_sampler(request: Request) -> dict[str, Any]:
        req: CreateSampler = await body(request, CreateSampler)
        sampler = service.create_sampler(
            who(request),
            req.session_id,
            req.sampling_session_seq_id,
            req.model_path,
            req.base_model,
        )
        return {"sampling_session_id": sampler, "type": "create_sampling_session"}

    @api.get(v1 + "/samplers/{sampler}")
    async def get_sampler(request: Request, sampler: str) -> dict[str, Any]:
        return service.sampler_info(who(request), sampler)

    @api.post(f"{v1}/asample")
    async def asample(request: Request) -> dict[str, Any]:
        req: Sample = await body(request, Sample)
        if req.prompt_logprobs or req.topk_prompt_logprobs or req.topk_sample_logprobs:
            raise Refused("prompt and top-k logprobs: Orbit's engines return sampled logprobs only")
        if req.prompt_alt_tokens_k:
            raise Refused("prompt_alt_tokens_k: not served by Orbit's engines")
        prompt = []
        for chunk in req.prompt.chunks:
            if chunk.type != "encoded_text":
                raise Refused(f"prompt: a {chunk.type} chunk; Orbit serves text models")
            prompt += chunk.tokens
        params, stops = _sampling(req.sampling_params, service.max_context - len(prompt))
        record = service.sample(
            who(request), req.sampling_session_id, prompt, params, req.num_samples, stops
        )
        ids = [f"{record.id}:{i}" for i in range(req.num_samples)]
        return {"request_id": record.id, "sample_sequence_ids": ids}

    # ---- RestClient: training runs and checkpoints -----------------------------------------

    @api.get(f"{v1}/training_runs")
    async def training_runs(request: Request, limit: int = 20, offset: int = 0) -> dict[str, Any]:
        runs = service.training_runs(who(request))
        return {
            "training_runs": runs[offset : offset + limit],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)},
        }

    @api.get(v1 + "/training_runs/{run}")
    async def training_run(request: Request, run: str) -> dict[str, Any]:
        return service.training_run(who(request), run)

    @api.get(v1 + "/training_runs/{run}/checkpoints")
    async def run_checkpoints(request: Request, run: str) -> dict[str, Any]:
        service.training_run(who(request), run)  # 404 for a run that is not the tenant's
        found = [rest_checkpoint(c) for c in service.checkpoints.of(who(request), run)]
        return {"checkpoints": found, "cursor": None}

    @api.get(f"{v1}/checkpoints")
    async def checkpoints(request: Request, limit: int = 100, offset: int = 0) -> dict[str, Any]:
        found = [rest_checkpoint(c) for c in service.checkpoints.of(who(request))]
        return {
            "checkpoints": found[offset : offset + limit],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(found)},
        }

    @api.delete(v1 + "/training_runs/{run}/checkpoints/{kind}/{name}")
    async def delete_checkpoint(request: Request, run: str, kind: str, name: str) -> dict[str, Any]:
        service.delete_checkpoint(who(request), f"tinker://{run}/{kind}/{name}")
        return {}

    @api.post(f"{v1}/weights_info")
    async def weights_info(request: Request) -> dict[str, Any]:
        data = await fields(request)
        return service.weights_info(who(request), str(data.get("tinker_path", "")))

    @api.post(f"{v1}/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        data = await fields(request)
        found = service.futures.get(str(data.get("request_id", "")), who(request))
        if found is None:
            raise NotFound(f"no request {str(data.get('request_id'))[:80]!r} (or it expired)")
        if isinstance(found, Record) and not await service.futures.wait(found):
            return JSONResponse(
                {"type": "try_again", "request_id": found.id, "queue_state": "active"}
            )
        outcome = result_of(found)
        if isinstance(outcome, RequestFailed):
            return JSONResponse({"error": str(outcome), "category": outcome.category})
        result, proto = outcome
        if proto:
            return Response(result, media_type=PROTO)
        if isinstance(result, bytes):  # a stored JSON result
            return Response(result, media_type="application/json")
        return JSONResponse(result)

    return api


def _sampling(params: Sampling, room: int) -> tuple[SamplingParams, Stops]:
    """Tinker's sampling parameters as an engine's: max_tokens unset is the context left; top_k -1
    is off; `stop` a string, strings, or token ids (EOS ends a sample too, unless `stop` is [])."""
    if params.temperature < 0 or not 0.0 < params.top_p <= 1.0 or params.top_k < -1:
        raise Refused(
            f"sampling_params: temperature {params.temperature}, top_p {params.top_p}, top_k "
            f"{params.top_k} out of range (temperature >= 0, 0 < top_p <= 1, top_k >= -1)"
        )
    max_tokens = params.max_tokens if params.max_tokens is not None else room
    if max_tokens < 1:
        raise Refused(f"sampling_params.max_tokens: {max_tokens}; at least 1")
    stop = params.stop
    if stop is None:
        stops = Stops()
    elif isinstance(stop, str):
        stops = Stops(strings=(stop,))
    elif stop == []:
        stops = Stops(eos=False)
    elif all(isinstance(s, int) for s in stop):
        stops = Stops(token_ids=tuple(int(s) for s in stop))
    else:
        stops = Stops(strings=tuple(str(s) for s in stop))
    engine = SamplingParams(
        max_new_tokens=max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=max(params.top_k, 0),
        seed=params.seed,
    )
    return engine, stops
