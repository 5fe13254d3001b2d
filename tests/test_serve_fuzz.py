"""`orbit serve` under any input: a property-based fuzzer (hypothesis) over every route of the
Tinker API, every field of the request types the `tinker` SDK 0.38 sends, and every tensor encoding
its forward_backward protobuf allows, sent as raw HTTP with a valid key. For every request:
- the process lives (its health check answers after each one);
- the answer is never a 5xx;
- a request accepted (200, a request id) never fails later as the server's own error: its future
  ends in a result, or a failure of category "user";
- no answer shows a path of the server's (its directory, the model's, the checkout's, the home
  directory), but where it names the base model as the client did (by its path, here) and the
  tokenizer the SDK loads (`tokenizer_id`);
and every id of another tenant's (session, training client, sampling session, checkpoint, future)
is a 404 on every route that takes one.

The examples are derived from the test's name (`derandomize`): the same every run, so that CI never
flakes on a new one; `ORBIT_FUZZ=N` runs N fresh random examples per test instead, to look for
more (what that found is in docs/tinker.md, "Under any input").
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tinker_helpers import ROOT, sdk, serving

from orbit.serve import tinker_pb2 as pb
from orbit.serve.command import Options
from orbit.serve.keys import read_keys
from orbit.serve.service import Quotas

pytestmark = pytest.mark.slow

KEY_A, KEY_B = "tml-fuzz-a-51c3", "tml-fuzz-b-77e0"
SERVICE = Path(__file__).resolve().parent / "tinker" / "sdk_service.py"
SEEN: Counter[tuple[str, str]] = Counter()  # (route, status or the future's outcome): how often
FRESH = int(os.environ.get("ORBIT_FUZZ", "0"))
EXAMPLES = FRESH or 250


def _settings(examples: int = EXAMPLES):
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=not FRESH,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


@pytest.fixture(scope="module")
def fuzzed(tiny_llama, tmp_path_factory):
    """One service, two tenants, each with a training client, its saved state, a named sampler and a
    sampling session made through the SDK; (url, service, A's things, B's things, paths to hide)."""
    keys_file = tmp_path_factory.mktemp("keys") / "keys"
    keys_file.write_text(f"{KEY_A}\n{KEY_B}\n")
    directory = tmp_path_factory.mktemp("serve-fuzz")
    options = Options(keys=read_keys(keys_file), quotas=Quotas(session_timeout_s=3600))
    with serving(tiny_llama, directory, options) as (url, service):
        a = sdk(url, tiny_llama, "owner", key=KEY_A, script=SERVICE)
        b = sdk(url, tiny_llama, "owner", key=KEY_B, script=SERVICE)
        hidden = {str(directory.resolve()), str(tiny_llama.resolve()), str(ROOT)}
        hidden.add(os.path.expanduser("~"))
        with httpx.Client(base_url=f"{url}/api/v1", timeout=120) as client:
            yield client, service, a, b, hidden
    routes = {r for r, _ in SEEN}
    print(f"\nfuzzed: {SEEN.total()} requests on {len(routes)} routes; answers per route:")
    for route in sorted(routes):
        print(
            f"  {route}: "
            + ", ".join(f"{c}×{n}" for (r, c), n in sorted(SEEN.items()) if r == route)
        )


# ---- values --------------------------------------------------------------------------------

JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=24),
    st.sampled_from(
        [
            "",
            "/",
            "..",
            "../../etc/passwd",
            "tinker://",
            "tinker://x/weights/../../y",
            "\x00",
            "a" * 5000,
            "tinker://a:train:0/sampler_weights/..",
            "%2e%2e",
            "nobody:train:0",
        ]
    ),
    st.lists(st.integers(-5, 2**40), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
)


def _or_junk(good: st.SearchStrategy) -> st.SearchStrategy:
    """`good` most of the time, junk one time in six: a request is mostly well formed, so that it
    reaches past the first check. (Hypothesis draws an interval's ends often, its low end most:
    the rare branches here sit at the high end.)"""
    return st.integers(0, 5).flatmap(lambda i: JUNK if i == 5 else good)


def _ints(lo: int, hi: int) -> st.SearchStrategy:
    return _or_junk(st.integers(lo, hi))


def _floats() -> st.SearchStrategy:
    return _or_junk(st.one_of(st.floats(-2.0, 2.0), st.sampled_from([0.0, 1e-4, 1e30, -1e30])))


def _one_of(*good) -> st.SearchStrategy:
    return _or_junk(st.sampled_from(list(good)))


def _maybe(fields: dict[str, st.SearchStrategy], *required: str) -> st.SearchStrategy:
    """A JSON object of `fields` (each valid or junk): the `required` ones nearly always, the others
    now and then, and, now and then, one Orbit does not know."""

    @st.composite
    def body(draw) -> dict:
        out = {}
        for name, values in fields.items():
            if draw(st.integers(0, 9)) < (9 if name in required else 5):
                out[name] = draw(values)
        if draw(st.integers(0, 9)) == 9:
            out[draw(st.sampled_from(["zzz", "model", "type"]))] = draw(JUNK)
        return out

    return body()


def _json_routes(a: dict, b: dict, model: str) -> dict[str, st.SearchStrategy]:
    """Per JSON route, its bodies: the fields of the SDK's request type, each one of tenant B's own
    values or junk."""
    session = b["model_id"].split(":")[0]
    chunk = st.fixed_dictionaries(
        {
            "type": _one_of(*["encoded_text"] * 9, "image"),
            "tokens": _or_junk(st.lists(st.integers(-1, 200), min_size=1, max_size=8)),
        }
    )
    adam = _maybe(
        {
            k: _floats()
            for k in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
        }
    )
    sampling = _maybe(
        {
            "max_tokens": _ints(1, 8),
            "seed": _ints(-1, 2**40),
            "stop": _or_junk(
                st.one_of(
                    st.text(max_size=3),
                    st.lists(st.text(max_size=3), max_size=2),
                    st.lists(st.integers(0, 150), max_size=2),
                )
            ),
            "temperature": _or_junk(st.floats(0.0, 2.0)),
            "top_k": _ints(-1, 50),
            "top_p": _or_junk(st.floats(0.05, 1.0)),
        }
    )
    lora = _maybe(
        {
            "rank": _ints(-1, 8),
            "seed": _ints(-1, 10),
            "train_mlp": st.booleans(),
            "train_attn": st.booleans(),
            "train_unembed": st.booleans(),
        }
    )
    model_id = _one_of(b["model_id"])
    paths = _one_of(b["state"], b["sampler_path"])
    return {
        "client/config": _maybe({"sdk_version": JUNK}),
        "create_session": _maybe({"tags": JUNK, "user_metadata": JUNK, "sdk_version": JUNK}),
        "session_heartbeat": _maybe({"session_id": _one_of(session)}, "session_id"),
        "telemetry": _maybe({"events": JUNK, "session_id": JUNK}),
        "create_model": _maybe(
            {
                "session_id": _one_of(session),
                "model_seq_id": _ints(0, 2**31),
                "base_model": _one_of(model),
                "lora_config": lora,
                "user_metadata": JUNK,
                "optimizer_config": JUNK,
            },
            "session_id",
            "model_seq_id",
            "base_model",
        ),
        "get_info": _maybe({"model_id": model_id}, "model_id"),
        "optim_step": _maybe(
            {"model_id": model_id, "seq_id": _ints(0, 50), "adam_params": adam}, "model_id"
        ),
        "save_weights": _maybe(
            {
                "model_id": model_id,
                "path": _one_of("fuzz", "a/b", "x.y"),
                "seq_id": _ints(0, 50),
                "overwrite": st.booleans(),
                "ttl_seconds": _ints(3600, 10**9),
                "user_metadata": JUNK,
            },
            "model_id",
            "path",
        ),
        "save_weights_for_sampler": _maybe(
            {
                "model_id": model_id,
                "path": _one_of("fuzz-s"),
                "seq_id": _ints(0, 50),
                "sampling_session_seq_id": _ints(0, 2**31),
                "kind": _one_of("snapshot", "inflight"),
                "ttl_seconds": _ints(3600, 10**9),
            },
            "model_id",
            "sampling_session_seq_id",
        ),
        "load_weights": _maybe(
            {
                "path": paths,
                "optimizer": st.booleans(),
                "model_id": model_id,
                "seq_id": _ints(0, 50),
                "session_id": _one_of(session),
                "model_seq_id": _ints(0, 2**31),
            },
            "path",
        ),
        "create_sampling_session": _maybe(
            {
                "session_id": _one_of(session),
                "sampling_session_seq_id": _ints(0, 2**31),
                "model_path": paths,
                "base_model": _one_of(model),
            },
            "session_id",
            "sampling_session_seq_id",
        ),
        "asample": _maybe(
            {
                "sampling_session_id": _one_of(b["sampler_id"]),
                "prompt": _maybe(
                    {"chunks": _or_junk(st.lists(chunk, min_size=1, max_size=3))}, "chunks"
                ),
                "sampling_params": sampling,
                "num_samples": _ints(1, 4),
                "prompt_logprobs": st.booleans(),
                "topk_prompt_logprobs": _ints(0, 3),
                "prompt_logprobs_last_n": _ints(1, 4),
                "topk_sample_logprobs": _ints(0, 3),
                "target_prompt_logprobs": _or_junk(
                    _maybe(
                        {
                            "data": st.lists(_ints(-1, 40), max_size=8),
                            "dtype": st.sampled_from(["int64", "float32"]),
                            "shape": st.lists(_ints(0, 4), max_size=3),
                            "sparse_crow_indices": st.lists(_ints(0, 4), max_size=4),
                            "sparse_col_indices": st.lists(_ints(0, 4), max_size=4),
                        },
                        "data",
                        "dtype",
                    )
                ),
            },
            "sampling_session_id",
            "prompt",
        ),
        "weights_info": _maybe({"tinker_path": paths}, "tinker_path"),
        "retrieve_future": _maybe({"request_id": JUNK}),
    }


_DTYPES = {
    pb.DTYPE_FLOAT32: torch.float32,
    pb.DTYPE_INT64: torch.int64,
    pb.DTYPE_INT32: torch.int32,
    pb.DTYPE_BFLOAT16: torch.bfloat16,
}


INPUTS = {  # what each loss reads, besides target_tokens
    "cross_entropy": ["weights"],
    "importance_sampling": ["logprobs", "advantages"],
    "ppo": ["logprobs", "advantages"],
    "cispo": ["logprobs", "advantages"],
}


def _bytes(values: list[float], kind: torch.dtype) -> bytes:
    t = torch.tensor(values, dtype=torch.float64).to(kind)
    return (t.view(torch.int16) if kind == torch.bfloat16 else t).numpy().tobytes()


@st.composite
def _tensor(draw, n: int, kind: torch.dtype) -> pb.Tensor:
    """A loss input for a datum of `n` tokens, mostly as the SDK encodes it (dense, `kind`, shape
    [n]); else in another dtype (one unknown too), of a size or shape that does not fit, cut short,
    or sparse CSR with indices in range or not."""
    odd = draw(st.integers(0, 7)) == 7
    dtype = draw(st.sampled_from([*_DTYPES, 0, 9])) if odd else _CODE[kind]
    kind = _DTYPES.get(dtype, torch.float32)
    size = draw(st.integers(0, n + 2)) if odd and draw(st.booleans()) else n
    special = st.sampled_from([float("nan"), float("inf"), 1e9, -1e9])
    values = draw(
        st.lists(
            st.one_of(st.integers(0, 150).map(float), st.floats(-3, 3), special)
            if odd
            else st.integers(0, 150).map(float)
            if kind == torch.int64
            else st.floats(-3, 3),
            min_size=size,
            max_size=size,
        )
    )
    raw = _bytes(values, kind)
    if odd and draw(st.booleans()):
        raw = raw[: max(len(raw) - 1, 0)]
    shape = (
        draw(st.lists(st.integers(-1, n + 1), max_size=3))
        if odd and draw(st.booleans())
        else [size]
    )
    if not (odd and draw(st.booleans())):
        return pb.Tensor(dtype=dtype, shape=shape, dense=raw)
    rows = draw(st.integers(1, 3))
    crow = draw(st.lists(st.integers(-1, size + 1), min_size=rows + 1, max_size=rows + 1))
    col = draw(st.lists(st.integers(-1, 2**40), min_size=size, max_size=size))
    csr = pb.SparseCsr(
        values=raw,
        crow_indices=torch.tensor(crow, dtype=torch.int64).numpy().tobytes(),
        col_indices=torch.tensor(col, dtype=torch.int64).numpy().tobytes(),
    )
    shape = draw(st.sampled_from([[rows, n], [rows, 2**40], [-1, n], shape]))
    return pb.Tensor(dtype=dtype, shape=shape, sparse_csr=csr)


_CODE = {v: k for k, v in _DTYPES.items()}


@st.composite
def _forward_backward(draw, model_id: str) -> tuple[bytes, dict]:
    """A forward_backward body: the SDK's protobuf, mostly well formed (each part odd now and then),
    or bytes that are none, plain or zstd-compressed."""
    loss = draw(_or_junk(st.sampled_from(sorted(INPUTS))))
    loss = loss if isinstance(loss, str) else "dro"
    datums = []
    for _ in range(draw(st.sampled_from([1, 1, 2, 3, 0]))):
        n = draw(st.integers(1, 6))
        tokens = draw(st.lists(st.integers(0, 150), min_size=n, max_size=n))
        if draw(st.integers(0, 9)) == 9:
            tokens[0] = draw(st.sampled_from([-2, 10**6, 2**31 - 1]))
        datum = pb.Datum()
        chunk = datum.model_input.add()
        if draw(st.integers(0, 19)) == 19:
            chunk.image.data, chunk.image.format = b"\x89PNG", "png"
        else:
            raw = torch.tensor(tokens, dtype=torch.int32).numpy().tobytes()
            cut = 2 if draw(st.integers(0, 9)) == 9 else 0
            chunk.encoded_text.tokens = raw[: len(raw) - cut]
        names = ["target_tokens", *INPUTS.get(loss, ["weights"])]
        if draw(st.integers(0, 9)) == 9:
            names = draw(
                st.lists(
                    st.sampled_from(
                        [
                            "target_tokens",
                            "weights",
                            "logprobs",
                            "advantages",
                            "mask",
                            "clip_low_threshold",
                        ]
                    ),
                    max_size=4,
                    unique=True,
                )
            )
        for name in names:
            kind = torch.int64 if name == "target_tokens" else torch.float32
            datum.loss_fn_inputs[name].CopyFrom(draw(_tensor(n, kind)))
        datums.append(datum)
    request = pb.ForwardBackwardRequest(
        model_id=draw(st.sampled_from([model_id] * 8 + ["", "nobody:train:0", "a" * 300])),
        seq_id=draw(st.sampled_from([0, 0, 0, -5, 2**31 - 1])),
        loss_fn=loss,
        data=datums,
        forward_only=draw(st.booleans()),
    )
    keys = ["clip_low_threshold", "clip_high_threshold", "beta", "zzz"]
    for key in draw(st.lists(st.sampled_from(keys), max_size=2, unique=True)) * (
        draw(st.integers(0, 3)) == 3
    ):
        request.loss_fn_config[key] = draw(st.floats(allow_nan=True, allow_infinity=True))
    body = request.SerializeToString()
    headers = {"content-type": "application/x-protobuf"}
    how = draw(st.sampled_from(["plain"] * 12 + ["zstd", "zstd", "truncated", "noise", "bad-zstd"]))
    if how == "zstd":
        import zstandard

        body, headers["content-encoding"] = zstandard.compress(body), "zstd"
    elif how == "bad-zstd":
        headers["content-encoding"] = "zstd"
    elif how == "truncated":
        body = body[: len(body) // 2]
    elif how == "noise":
        body = draw(st.binary(max_size=200))
    return body, headers


# ---- checks --------------------------------------------------------------------------------


def _check(client: httpx.Client, res: httpx.Response, hidden: set[str], what: str) -> None:
    """The answer is no 5xx and shows no server path; an accepted request's future ends as a
    result or the client's failure; the service still answers."""
    SEEN[what.split(" ")[0], str(res.status_code)] += 1
    if os.environ.get("ORBIT_FUZZ_SAY") and res.status_code != 200:  # what refused it, to tune
        print(what.split(" ")[0], res.status_code, res.text[:160])
    assert res.status_code < 500, (what, res.status_code, res.text[:500])
    text = _shown(res)
    assert not [h for h in hidden if h in text], (what, text[:500])
    if (
        res.status_code == 200
        and "request_id" in text
        and res.headers.get("content-type", "").startswith("application/json")
    ):
        request_id = res.json().get("request_id")
        if isinstance(request_id, str) and not what.startswith("retrieve_future"):
            _settled(client, request_id, hidden, what)
    assert client.get("/healthz").status_code == 200, what


# fields whose value is the base model as the client named it (here, by its path: the tests' SDK
# clients do), or the tokenizer the SDK loads from there: the client's own word, not a leak
NAMED = {"base_model", "model_name", "tokenizer_id"}


def _shown(res: httpx.Response) -> str:
    """What an answer shows, less the fields in NAMED."""
    if not res.headers.get("content-type", "").startswith("application/json"):
        return res.text

    def strip(x: object) -> object:
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in NAMED}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    return json.dumps(strip(res.json()))


def _settled(client: httpx.Client, request_id: str, hidden: set[str], what: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        res = client.post(
            "/retrieve_future", json={"request_id": request_id}, headers={"X-API-Key": KEY_B}
        )
        assert res.status_code == 200, (what, res.status_code, res.text[:300])
        json_body = res.headers.get("content-type", "").startswith("application/json")
        body = res.json() if json_body else {}
        if body.get("type") == "try_again":
            continue
        SEEN[what.split(" ")[0], "future " + ("failed" if "error" in body else "done")] += 1
        if "error" in body:
            assert body.get("category") == "user", (what, body)
            assert not [h for h in hidden if h in body["error"]], (what, body)
        return
    raise AssertionError(f"{what}: its future did not end within 120 s")


def _send(client: httpx.Client, key: str, route: str, body: object) -> httpx.Response:
    content = json.dumps(body).encode()  # NaN and Infinity as JSON numbers, as Python writes them
    return client.post(f"/{route}", content=content, headers={"X-API-Key": key})


# ---- the tests -----------------------------------------------------------------------------


@_settings()
@given(data=st.data())
def test_no_json_request_crashes_fails_as_the_servers_or_shows_a_path(fuzzed, data):
    client, service, a, b, hidden = fuzzed
    routes = _json_routes(a, b, str(service.bases[0].model))
    route = data.draw(st.sampled_from(sorted(routes)), label="route")
    body = data.draw(_or_junk(routes[route]), label="body")
    res = _send(client, KEY_B, route, body)
    _check(client, res, hidden, f"{route} {json.dumps(body)[:300]}")


@_settings()
@given(data=st.data())
def test_no_forward_backward_body_crashes_or_fails_as_the_servers(fuzzed, data):
    client, _, _, b, hidden = fuzzed
    body, headers = data.draw(_forward_backward(b["model_id"]), label="body")
    res = client.post("/forward_backward", content=body, headers={"X-API-Key": KEY_B, **headers})
    _check(client, res, hidden, f"forward_backward {body[:120]!r}")


@_settings(examples=FRESH or 120)
@given(data=st.data())
def test_no_path_or_query_crashes_or_shows_a_path(fuzzed, data):
    client, _, a, b, hidden = fuzzed
    part = st.one_of(
        st.sampled_from([b["model_id"], b["sampler_id"], "weights", "x"]),
        st.text(st.characters(blacklist_categories=["Cs"]), max_size=12),
    )
    route = data.draw(
        st.sampled_from(
            [
                "samplers/{}",
                "training_runs/{}",
                "training_runs/{}/checkpoints",
                "sessions/{}/finish",
                "training_runs/{}/checkpoints/{}/{}",
                "training_runs",
                "checkpoints",
            ]
        ),
        label="route",
    )
    parts = [data.draw(part) for _ in range(route.count("{}"))]
    # finishing B's own session would end the fuzz: only other sessions' ids there
    if route.startswith("sessions/") and parts[0] == b["model_id"].split(":")[0]:
        parts[0] = "nobody"
    path = route.format(*[quote(p, safe="") or "x" for p in parts])
    query = data.draw(
        st.dictionaries(
            st.sampled_from(["limit", "offset"]),
            st.one_of(st.integers(-5, 2**70).map(str), st.text(max_size=5)),
            max_size=2,
        )
    )
    method = "DELETE" if route.count("{}") == 3 else "POST" if "finish" in route else "GET"
    res = client.request(method, f"/{path}", params=query, headers={"X-API-Key": KEY_B})
    _check(client, res, hidden, f"{method} {path} {query}")


def _a_ids(a: dict, b: dict) -> list[tuple[str, str, dict]]:
    """Every route that takes an id, with tenant A's ids in it, B's own beside them where a route
    takes two (method, route, body)."""
    session, b_session = a["model_id"].split(":")[0], b["model_id"].split(":")[0]
    mid, sid, state, spath = a["model_id"], a["sampler_id"], a["state"], a["sampler_path"]
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}
    run, kind, name = state.removeprefix("tinker://").split("/")
    return [
        ("POST", "session_heartbeat", {"session_id": session}),
        ("POST", f"sessions/{session}/finish", {}),
        ("POST", "unload_model", {"model_id": mid}),
        ("POST", "create_model", {"session_id": session, "model_seq_id": 7, "base_model": "m"}),
        ("POST", "get_info", {"model_id": mid}),
        ("POST", "optim_step", {"model_id": mid, "seq_id": 99}),
        ("POST", "save_weights", {"model_id": mid, "path": "stolen"}),
        ("POST", "save_weights_for_sampler", {"model_id": mid, "kind": "inflight"}),
        ("POST", "load_weights", {"path": state, "model_id": b["model_id"]}),
        ("POST", "load_weights", {"path": state, "session_id": b_session, "model_seq_id": 3}),
        ("POST", "load_weights", {"path": "tinker://nobody/weights/x", "model_id": mid}),
        (
            "POST",
            "load_weights",
            {"path": "tinker://nobody/weights/x", "session_id": session, "model_seq_id": 3},
        ),
        ("POST", "create_sampling_session", {"session_id": session, "sampling_session_seq_id": 9}),
        (
            "POST",
            "create_sampling_session",
            {"session_id": b_session, "sampling_session_seq_id": 9, "model_path": spath},
        ),
        ("GET", f"samplers/{sid}", {}),
        ("POST", "asample", {"sampling_session_id": sid, "prompt": prompt}),
        ("GET", f"training_runs/{mid}", {}),
        ("GET", f"training_runs/{mid}/checkpoints", {}),
        ("DELETE", f"training_runs/{run}/checkpoints/{kind}/{name}", {}),
        ("POST", "weights_info", {"tinker_path": spath}),
        ("POST", "retrieve_future", {"request_id": a["request_id"]}),
        ("FB", "forward_backward", {"model_id": mid}),
    ]


def test_every_id_of_another_tenant_is_a_404_on_every_route(fuzzed):
    client, service, a, b, hidden = fuzzed
    step = {"model_id": a["model_id"], "adam_params": {"learning_rate": 0.0}}
    a = {**a, "request_id": _send(client, KEY_A, "optim_step", step).json()["request_id"]}
    routes = _a_ids(a, b)
    for method, route, body in routes:
        if method == "FB":
            fb = pb.ForwardBackwardRequest(model_id=body["model_id"], loss_fn="cross_entropy")
            datum = fb.data.add()
            datum.model_input.add().encoded_text.tokens = b"\x01\x00\x00\x00\x02\x00\x00\x00"
            res = client.post(
                "/forward_backward", content=fb.SerializeToString(), headers={"X-API-Key": KEY_B}
            )
        elif method == "POST":
            res = _send(client, KEY_B, route, body)
        else:
            res = client.request(method, f"/{route}", headers={"X-API-Key": KEY_B})
        assert res.status_code == 404, (method, route, res.status_code, res.text[:300])
        assert not [h for h in hidden if h in res.text], (route, res.text)
    print(
        f"\n{len(routes)} requests with another tenant's ids, on {len({r for _, r, _ in routes})} "
        "routes: each a 404"
    )
    # and A's things are as they were: its client trains, its session lives
    res = _send(client, KEY_A, "get_info", {"model_id": a["model_id"]})
    assert res.status_code == 200, res.text
    res = _send(client, KEY_A, "session_heartbeat", {"session_id": a["model_id"].split(":")[0]})
    assert res.status_code == 200, res.text
