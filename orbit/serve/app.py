"""The Tinker HTTP API, as the `tinker` SDK 0.38 speaks it (docs/tinker.md has the table of calls):
JSON everywhere but forward_backward's request and the results of forward_backward and asample,
which are protocol buffers (wire.py). Mutating calls answer a request id at once; `retrieve_future`
waits for the result (futures.py).

A request Orbit refuses gets a 4xx with a JSON body naming what was wrong (the SDK treats an empty
4xx as a proxy's hiccup and retries it); a failure inside a future answers `{"error", "category"}`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import ValidationError

from orbit.engine.base import SamplingParams
from orbit.serve import exports, provenance, search, wire
from orbit.serve.bodies import (
    NOT_SERVED,
    Adam,
    Body,
    ClientConfig,
    CopyWeights,
    CreateModel,
    CreateSampler,
    CreateSession,
    GetInfo,
    LoadWeights,
    OptimStep,
    RetrieveFuture,
    Sample,
    Sampling,
    SaveExternal,
    SaveForSampler,
    SaveWeights,
    SearchSessions,
    SessionHeartbeat,
    SetTtl,
    StorageUsage,
    Telemetry,
    TensorJson,
    UnloadModel,
)
from orbit.serve.clients import AdamParams, LoraSpec
from orbit.serve.futures import Busy, Gone, NotFound, Record, Refused, RequestFailed, result_of
from orbit.serve.keys import Keys
from orbit.serve.samplers import Stops
from orbit.serve.service import Service

PROTO = "application/x-protobuf"
MAX_BODY = 64 * 2**20  # bytes a request may carry (the SDK cuts a forward_backward at ~5 MB)
OPEN = {"/api/v1/healthz"}  # answered without a key (and a download link: its token is signed)


B = TypeVar("B", bound=Body)


class TooLarge(Refused):
    """A request body past the limit (HTTP 413)."""


class Unauthorized(Refused):
    """No key, or one the service does not take (HTTP 401)."""


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
        if request.url.path not in OPEN and not request.url.path.startswith(exports.ROUTE):
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

    async def body(request: Request, model: type[B]) -> B:
        """The request as `model` declares it: a field it does not know, or one Orbit does not
        serve set, is refused, named (bodies.py)."""
        req = model.model_validate(await fields(request))
        req.refuse_unserved()
        return req

    def future(record: Record) -> dict[str, Any]:
        return {"request_id": record.id}

    v1 = "/api/v1"

    @api.post(f"{v1}/client/config")
    async def client_config(request: Request) -> dict[str, Any]:
        await body(request, ClientConfig)
        # a forward_backward's chunks one after another, as every other request: then a request's
        # arrival means each number below it arrived or never will (training.py)
        return {"parallel_fwdbwd_chunks": False}

    @api.post(f"{v1}/create_session")
    async def create_session(request: Request) -> dict[str, Any]:
        req = await body(request, CreateSession)
        if req.project_id is not None:  # the key's one project, or refused
            search.check_projects(who(request), [req.project_id])
        session = service.create_session(
            who(request), req.user_metadata or {}, req.tags, req.display_name
        )
        return {"session_id": session, "type": "create_session"}

    @api.post(f"{v1}/session_heartbeat")
    async def heartbeat(request: Request) -> dict[str, Any]:
        req = await body(request, SessionHeartbeat)
        service.heartbeat(who(request), req.session_id)
        return {}

    @api.post(v1 + "/sessions/{session}/finish")
    async def finish(session: str, request: Request) -> dict[str, Any]:
        data = await fields(request)
        reason = data.get("reason")
        kind = reason.get("type") if isinstance(reason, dict) else None
        detail = data.get("detail")
        finish = kind if kind in search.FINISHES else None  # the SDK sends one of them
        detail = str(detail)[:2000] if detail is not None else None
        service.finish_session(who(request), session, finish, detail)
        return {}

    @api.post(f"{v1}/unload_model")
    async def unload_model(request: Request) -> dict[str, Any]:
        req = await body(request, UnloadModel)
        return future(service.unload_model(who(request), req.model_id))

    @api.post(f"{v1}/telemetry")
    async def telemetry(request: Request) -> dict[str, Any]:
        await body(request, Telemetry)  # taken, kept nowhere: Orbit collects no telemetry
        return {"status": "accepted"}

    @api.get(f"{v1}/get_server_capabilities")
    async def capabilities() -> dict[str, Any]:
        return service.capabilities()

    @api.get(f"{v1}/healthz")
    async def health() -> dict[str, Any]:
        return {"status": "ok"}

    @api.post(f"{v1}/create_model")
    async def create_model(request: Request) -> dict[str, Any]:
        req = await body(request, CreateModel)
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
        req = await body(request, GetInfo)
        return service.info(who(request), req.model_id)

    @api.post(f"{v1}/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        data = await raw(request)
        if "zstd" in request.headers.get("content-encoding", ""):
            data = wire.unzstd(data, MAX_BODY)
        return future(service.forward_backward(who(request), wire.forward_backward(data)))

    @api.post(f"{v1}/optim_step")
    async def optim_step(request: Request) -> dict[str, Any]:
        req = await body(request, OptimStep)
        adam = AdamParams(**(req.optim_params or Adam()).model_dump())
        return future(service.optim_step(who(request), req.model_id, req.seq_id, adam))

    @api.post(f"{v1}/save_weights")
    async def save_weights(request: Request) -> dict[str, Any]:
        req = await body(request, SaveWeights)
        record = service.save_state(
            who(request),
            req.model_id,
            req.seq_id,
            req.path,
            req.overwrite,
            req.ttl_seconds,
            req.user_metadata,
        )
        return future(record)

    @api.post(f"{v1}/save_weights_external")
    async def save_external(request: Request) -> dict[str, Any]:
        req = await body(request, SaveExternal)
        record = service.save_external(
            who(request),
            req.model_id,
            req.seq_id or 0,
            req.path,
            req.ttl_seconds,
            req.age_encryption_recipients,
        )
        return future(record)

    @api.get(v1 + "/training_runs/{run}/checkpoints/{kind}/{name}/external_weights_urls")
    async def external_urls(request: Request, run: str, kind: str, name: str) -> dict[str, Any]:
        path = f"tinker://{run}/{kind}/{name}"
        return service.listings.external_urls(who(request), path, str(request.base_url))

    @api.get(exports.ROUTE + "{token}")
    async def external_file(token: str) -> FileResponse:
        return FileResponse(service.listings.external_file(token))

    @api.post(f"{v1}/save_weights_for_sampler")
    async def save_for_sampler(request: Request) -> dict[str, Any]:
        req = await body(request, SaveForSampler)
        record = service.save_for_sampler(
            who(request),
            req.model_id,
            req.seq_id,
            req.path,
            req.sampling_session_seq_id,
            req.kind,
            req.ttl_seconds,
            req.user_metadata,
        )
        return future(record)

    @api.post(f"{v1}/load_weights")
    async def load_weights(request: Request) -> dict[str, Any]:
        req = await body(request, LoadWeights)
        optimizer = (req.optimizer_config or {}).get("type", "adamw")
        if optimizer != "adamw":
            raise Refused(
                f"optimizer_config.type: {str(optimizer)[:40]!r}; Orbit trains with adamw"
            )
        record = service.load_state(
            who(request),
            req.path,
            req.optimizer,
            req.model_id,
            req.seq_id,
            req.session_id,
            req.model_seq_id,
            req.base_model,
            req.user_metadata,
        )
        return future(record)

    @api.post(f"{v1}/create_sampling_session")
    async def create_sampler(request: Request) -> dict[str, Any]:
        req = await body(request, CreateSampler)
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
        req = await body(request, Sample)
        if req.sampling_session_id is None:
            raise Refused("sampling_session_id: required (create_sampling_session makes one)")
        prompt = []
        for chunk in req.prompt.chunks:
            if chunk.type != "encoded_text":
                raise Refused(f"prompt: a {chunk.type} chunk; Orbit serves text models")
            prompt += chunk.tokens
        base = service.sampling_base(who(request), req.sampling_session_id)
        params, stops = _sampling(req.sampling_params, base.max_context - len(prompt))
        params = dataclasses.replace(
            params,
            prompt_logprobs=_prompt_logprobs(req, len(prompt)),
            output_top=_top_k("topk_sample_logprobs", req.topk_sample_logprobs),
        )
        targets = _targets(req.target_prompt_logprobs, len(prompt), base.vocab_size)
        record = service.sample(
            who(request),
            req.sampling_session_id,
            base,
            prompt,
            params,
            req.num_samples,
            stops,
            req.seq_id,
            req.prompt_logprobs_last_n,
            req.record_stability_info,
            targets,
        )
        ids = provenance.sequence_ids(record.id, req.num_samples)
        return {"request_id": record.id, "sample_sequence_ids": ids}

    # ---- RestClient: training runs and checkpoints -----------------------------------------

    @api.get(f"{v1}/training_runs")
    async def training_runs(request: Request, limit: int = 20, offset: int = 0) -> dict[str, Any]:
        runs = service.listings.training_runs(who(request))
        return {
            "training_runs": runs[offset : offset + limit],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)},
        }

    @api.get(v1 + "/training_runs/{run}")
    async def training_run(request: Request, run: str) -> dict[str, Any]:
        return service.listings.training_run(who(request), run)

    @api.get(v1 + "/training_runs/{run}/checkpoints")
    async def run_checkpoints(request: Request, run: str) -> dict[str, Any]:
        return service.listings.run_checkpoints(who(request), run)

    @api.get(f"{v1}/checkpoints")
    async def checkpoints(request: Request, limit: int = 100, offset: int = 0) -> dict[str, Any]:
        return service.listings.checkpoints_page(who(request), limit, offset)

    @api.delete(v1 + "/training_runs/{run}/checkpoints/{kind}/{name}")
    async def delete_checkpoint(request: Request, run: str, kind: str, name: str) -> dict[str, Any]:
        service.delete_checkpoint(who(request), f"tinker://{run}/{kind}/{name}")
        return {}

    @api.post(v1 + "/training_runs/{run}/checkpoints/{kind}/{name}/publish")
    async def publish(request: Request, run: str, kind: str, name: str) -> dict[str, Any]:
        service.publish_checkpoint(who(request), f"tinker://{run}/{kind}/{name}", True)
        return {}

    @api.delete(v1 + "/training_runs/{run}/checkpoints/{kind}/{name}/publish")
    async def unpublish(request: Request, run: str, kind: str, name: str) -> dict[str, Any]:
        service.publish_checkpoint(who(request), f"tinker://{run}/{kind}/{name}", False)
        return {}

    @api.put(v1 + "/training_runs/{run}/checkpoints/{kind}/{name}/ttl")
    async def set_ttl(request: Request, run: str, kind: str, name: str) -> dict[str, Any]:
        req = await body(request, SetTtl)
        service.set_checkpoint_ttl(who(request), f"tinker://{run}/{kind}/{name}", req.ttl_seconds)
        return {}

    # ---- RestClient: sessions ------------------------------------------------------------------

    @api.get(f"{v1}/sessions")
    async def sessions(request: Request, limit: int = 20, offset: int = 0) -> dict[str, Any]:
        return {"sessions": service.listings.session_ids(who(request))[offset : offset + limit]}

    @api.get(v1 + "/sessions/{session}")
    async def session_info(request: Request, session: str) -> dict[str, Any]:
        return service.listings.session_info(who(request), session)

    @api.put(v1 + "/sessions/{session}/project")
    async def assign_project(request: Request, session: str) -> dict[str, Any]:
        """RestClient.assign_session_project: a session is in its key's one project already."""
        project = (await fields(request)).get("project_id")
        service.listings.session_info(who(request), session)  # the key's, or not found
        if not isinstance(project, str):
            raise Refused("project_id: required, a string")
        search.check_projects(who(request), [project])
        return {}

    @api.post(f"{v1}/copy_weights")
    async def copy_weights(request: Request) -> dict[str, Any]:
        req = await body(request, CopyWeights)
        if request.headers.get("X-Tinker-Weights-Access-Token"):  # where the SDK sends it
            raise Refused(f"weights_access_token: {CopyWeights.UNSERVED['weights_access_token']}")
        key = request.headers.get("X-Idempotency-Key")
        # it waits for the trainer's thread: off the event loop
        return await run_in_threadpool(service.copy_weights, who(request), req, key)

    @api.post(f"{v1}/sessions/search")
    async def search_sessions(request: Request) -> dict[str, Any]:
        return service.listings.search_sessions(who(request), await body(request, SearchSessions))

    @api.get(f"{v1}/billing/usage/checkpoints/current")
    async def storage_usage(request: Request) -> dict[str, Any]:
        req = StorageUsage.model_validate(dict(request.query_params))
        return service.listings.storage_usage(who(request), req.project_id)

    # ---- the SDK's routes Orbit does not serve: each a 400 naming why (not a 501: the SDK
    # retries every 5xx for five minutes) --------------------------------------------------------

    def not_served(route: str, why: str) -> Any:
        async def refuse() -> JSONResponse:
            return JSONResponse(
                {"detail": f"{route}: not served by orbit serve ({why})"}, status_code=400
            )

        return refuse

    for method, route, _, why in NOT_SERVED:
        api.add_api_route(v1 + route, not_served(route, why), methods=[method])

    @api.post(f"{v1}/weights_info")
    async def weights_info(request: Request) -> dict[str, Any]:
        data = await fields(request)
        return service.listings.weights_info(who(request), str(data.get("tinker_path", "")))

    @api.post(f"{v1}/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        req = await body(request, RetrieveFuture)
        found = service.futures.get(req.request_id, who(request))
        if found is None:
            raise NotFound(f"no request {req.request_id[:80]!r} (or it expired)")
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


MAX_TOP = 20  # top-k logprobs a request may ask for, per position (prompt or sampled)


def _top_k(field: str, k: int) -> int:
    if not 0 <= k <= MAX_TOP:
        raise Refused(f"{field}: {k}; from 0 to {MAX_TOP}")
    return k


def _prompt_logprobs(req: Sample, length: int) -> int:
    """What the engines are asked for (SamplingParams.prompt_logprobs): -1 none, 0 the prompt's
    logprobs, k also its top k; the request's values checked."""
    k = _top_k("topk_prompt_logprobs", req.topk_prompt_logprobs)
    last_n = req.prompt_logprobs_last_n
    if last_n is not None and not 1 <= last_n <= length - 1:
        raise Refused(f"prompt_logprobs_last_n: {last_n}; from 1 to the prompt's length - 1")
    return k if (req.prompt_logprobs or k or last_n is not None) else -1


def _targets(tensor: TensorJson | None, length: int, vocab: int) -> wire.Targets | None:
    """`target_prompt_logprobs` read and checked against the prompt (None: not asked for)."""
    if tensor is None:
        return None
    if tensor.dtype != "int64":
        raise Refused(f"target_prompt_logprobs: dtype {tensor.dtype}; token ids are int64")
    return wire.targets(
        tensor.data,
        tensor.shape,
        tensor.sparse_crow_indices,
        tensor.sparse_col_indices,
        length - 1,
        vocab,
    )


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
