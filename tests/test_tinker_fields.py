"""No field of the `tinker` SDK 0.38 is dropped in silence: every request type the SDK has is
served by a model that declares each of its fields (orbit/serve/bodies.py), or its route
answers 400 naming why; a field Orbit does not serve is refused when set, naming it; a field the
SDK does not have is refused; and the fields Orbit keeps do what the SDK says (a checkpoint's TTL
and metadata, a client's metadata, sessions, capabilities, a sample sent again)."""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import Future

import httpx
import pytest
from tinker_helpers import sdk, sdk_env, sdk_python, serving

from orbit.serve.bodies import INFORMATIONAL, NOT_SERVED, REQUESTS
from orbit.serve.futures import Gone, RequestFailed
from orbit.serve.keys import LOCAL

pytestmark = pytest.mark.slow

# the SDK's request types: their fields, and the names each may go by on the wire (aliases)
DUMP = """
import inspect, json, pydantic, tinker.types as t
out = {}
for name in dir(t):
    obj = getattr(t, name)
    if inspect.isclass(obj) and issubclass(obj, pydantic.BaseModel) and name.endswith("Request"):
        fields = {}
        for field, info in obj.model_fields.items():
            names = {field}
            alias = info.validation_alias
            if alias is not None:
                names |= {str(a) for a in getattr(alias, "choices", [alias])}
            fields[field] = sorted(names)
        out[name] = fields
print(json.dumps(out))
"""


def _sdk_requests() -> dict[str, dict[str, list[str]]]:
    res = subprocess.run(
        [str(sdk_python()), "-c", DUMP], capture_output=True, text=True, env=sdk_env("tml-x")
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout)


def _declared(model) -> set[str]:
    names = set()
    for field, info in model.model_fields.items():
        names.add(field)
        alias = info.validation_alias
        if alias is not None:
            names |= {str(a) for a in getattr(alias, "choices", [alias])}
    return names


def test_every_field_of_every_sdk_request_is_declared_or_its_route_refused():
    sdk_types = _sdk_requests()
    not_served = {kind for _, _, kind, _ in NOT_SERVED if kind}
    missing = sorted(set(sdk_types) - set(REQUESTS) - not_served)
    assert not missing, f"request types Orbit neither serves nor refuses: {missing}"
    dropped = []
    for kind, model in REQUESTS.items():
        declared = _declared(model)
        for field, names in sdk_types[kind].items():
            if not declared & set(names):
                dropped.append(f"{kind}.{field}")
    assert not dropped, f"fields the SDK sends that Orbit does not declare: {dropped}"
    print(
        f"\n{len(sdk_types)} request types of the SDK: {len(REQUESTS)} served, "
        f"{len(not_served)} refused by route; "
        f"{sum(len(f) for k, f in sdk_types.items() if k in REQUESTS)} fields declared, "
        f"{sum(len(m.UNSERVED) for m in REQUESTS.values())} of them refused when set, "
        f"{len(INFORMATIONAL)} names informational"
    )


@pytest.fixture(scope="module")
def served(tiny_llama, tmp_path_factory):
    with serving(tiny_llama, tmp_path_factory.mktemp("serve-fields")) as (url, service):
        yield url, service, tiny_llama


# a value that sets each refused field (anything but its default)
SETS = {
    "project_id": "p",
    "optimizer_params": {"type": "dimuon", "learning_rate": 0.1},
    "weights_access_token": "t",
    "base_model": "m",
    "model_path": "tinker://x/weights/y",
    "prompt_logprobs": True,
    "topk_prompt_logprobs": 2,
    "prompt_alt_tokens_k": 2,
    "prompt_logprobs_last_n": 3,
}
ROUTES = {
    "CreateSessionRequest": "create_session",
    "OptimStepRequest": "optim_step",
    "LoadWeightsRequest": "load_weights",
    "SampleRequest": "asample",
}
MINIMAL = {  # the fields each of those needs before its refused ones are read
    "OptimStepRequest": {"model_id": "m:train:0"},
    "LoadWeightsRequest": {"path": "tinker://m:train:0/weights/x"},
    "SampleRequest": {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1]}]}},
}


def test_a_field_orbit_does_not_serve_is_refused_by_name_and_so_is_an_unknown_one(served):
    url, _, _ = served
    refused = 0
    for kind, route in ROUTES.items():
        for field in REQUESTS[kind].UNSERVED:
            body = {**MINIMAL.get(kind, {}), field: SETS[field]}
            res = httpx.post(f"{url}/api/v1/{route}", json=body, timeout=30)
            assert res.status_code == 400 and field in res.json()["detail"], (kind, field, res.text)
            refused += 1
        res = httpx.post(f"{url}/api/v1/{route}", json={**MINIMAL.get(kind, {}), "zzz": 1})
        assert res.status_code == 400 and "zzz" in res.json()["detail"], (kind, res.text)
    assert refused == sum(len(REQUESTS[k].UNSERVED) for k in ROUTES)
    for method, route, _, why in NOT_SERVED:
        path = route.format(session="s", run="r", kind="weights", name="n")
        res = httpx.request(method, f"{url}/api/v1{path}", json={}, timeout=30)
        assert res.status_code == 400 and why in res.json()["detail"], (route, res.text)


def test_sessions_searched_and_their_storage(served):
    url, service, model = served
    seen = sdk(url, model, "sessions_search")
    a, b = seen["a"], seen["b"]
    assert seen["pages"] == [[b], [a], True]  # newest first, a page each
    assert seen["words"] == [a] and seen["team_sl"] == [b] and seen["errored"] == [b]
    assert a in seen["active"] and b not in seen["active"]
    summary = seen["summary"]
    assert summary["display_name"] == "Nightly sweep alpha" and summary["checkpoints_count"] == 1
    assert summary["user_metadata"] == {"team": "rl"} and summary["status"]["type"] == "active"
    saved = service.checkpoints.of(LOCAL)
    assert summary["checkpoint_storage_bytes"] == sum(c.size_bytes for c in saved if a in c.client)
    status = seen["b_status"]
    assert status["type"] == "client_finished" and status["reason"]["type"] == "errored"
    assert status["detail"] == "diverged"
    usage = seen["usage"]["data"]
    assert [u["checkpoint_count"] for u in usage] == [len(saved)]
    assert usage[0]["size_bytes"] == sum(c.size_bytes for c in saved) > 0
    assert "someone-else" in seen["other_project"] and "a key is a tenant" in seen["other_project"]


def test_a_checkpoint_copied_continues_exactly_and_its_run_is_not_trained(served):
    url, service, model = served
    seen = sdk(url, model, "copies")
    assert seen["copied"] != seen["source"] and seen["copied"].endswith("/weights/to-copy")
    assert seen["metadata"] == {"why": "archive"} and seen["expires"] not in (None, "None")
    a, b = seen["continued"]
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-6
    assert seen["run"]["model_owner"] == LOCAL and seen["run"]["lora_rank"] == 4
    run = seen["copied"].removeprefix("tinker://").split("/")[0]
    with pytest.raises(Gone, match="holds a copy of .*cannot be trained on"):
        service.client(LOCAL, run)
    assert "someone-else" in seen["other_project"] and "ttl_seconds: 60" in seen["short_ttl"]
    assert "weights_access_token" in seen["token"]
    # a session is in its key's one project: assigned to it, nothing changes; to another, refused
    assert seen["assigned"] == "" and "someone-else" in seen["assigned_other"]


def test_a_copy_into_a_sessions_run_takes_that_run(served):
    """copy_weights with session_id and model_seq_id (the SDK's wire; its method sends a project):
    the run is the copy's, and a training client made later in its place is refused."""
    url, service, model = served
    key = {"X-API-Key": "tml-x"}

    def post(route: str, body: dict) -> httpx.Response:
        return httpx.post(f"{url}/api/v1/{route}", json=body, headers=key, timeout=60)

    session = post("create_session", {"tags": [], "sdk_version": "0.38.0"}).json()["session_id"]

    def create(seq: int) -> Future:
        body = {"session_id": session, "model_seq_id": seq, "base_model": str(model)}
        made = post("create_model", {**body, "lora_config": {"rank": 4}})
        return service.futures.get(made.json()["request_id"], LOCAL).future

    create(0).result(60)
    run = f"{session}:train:0"
    save = lambda d: service.client(LOCAL, run).save(d, True)  # noqa: E731
    source = service.checkpoints.save(LOCAL, run, "weights", "src", save, False)
    copy = {"session_id": session, "model_seq_id": 5, "source_path": source}
    res = post("copy_weights", copy)
    assert res.status_code == 200, res.text
    assert res.json()["tinker_path"].startswith(f"tinker://{session}:train:5/")
    again = post("copy_weights", copy)
    assert again.status_code == 400 and "has a run" in again.json()["detail"]
    with pytest.raises(RequestFailed, match="exists; it holds a copy of"):
        create(5).result(60)


def test_what_the_fields_orbit_keeps_do(served):
    url, service, model = served
    seen = sdk(url, model, "fields")
    print("\n" + json.dumps(seen, indent=1)[:3000])
    assert seen["short_expires"] != "None" and seen["ttl_set"] not in (None, "None")
    assert seen["kept_metadata"] == {"renderer_name": "role_colon"}
    assert seen["run_metadata"] == {"from": "kept"}
    assert seen["expired"] and "expired at" in seen["expired"], seen["expired"]
    assert seen["short"] not in seen["listed_after"] and seen["kept"] in seen["listed_after"]
    assert seen["session"] in seen["sessions"] and len(seen["session_runs"]) == 2
    assert seen["published"] == [True], seen["published"]  # tests/test_serve_service.py: by whom
    assert seen["models"], seen
    # a checkpoint of another LoRA shape into a client: refused, naming both (it was a server error)
    assert seen["misfit"] and "rank 4" in seen["misfit"] and "rank 8" in seen["misfit"], seen
    assert "BadRequestError" in seen["misfit"], seen["misfit"]  # refused before it ran
    assert not any(m.startswith("/") for m in seen["models"]) or len(seen["models"]) == 1


def test_a_sample_sent_again_is_the_same_request_and_bad_targets_are_refused(served):
    url, service, model = served
    session = httpx.post(f"{url}/api/v1/create_session", json={}, timeout=30).json()["session_id"]
    body = {"session_id": session, "sampling_session_seq_id": 0, "base_model": str(model)}
    made = httpx.post(f"{url}/api/v1/create_sampling_session", json=body, timeout=30).json()
    sample = {
        "sampling_session_id": made["sampling_session_id"],
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "sampling_params": {"max_tokens": 4},
        "seq_id": 5,
    }
    first = httpx.post(f"{url}/api/v1/asample", json=sample, timeout=30).json()
    again = httpx.post(f"{url}/api/v1/asample", json=sample, timeout=30).json()
    other = httpx.post(f"{url}/api/v1/asample", json={**sample, "seq_id": 6}, timeout=30).json()
    assert first["request_id"] == again["request_id"] != other["request_id"]
    # target_prompt_logprobs the prompt cannot take: refused, naming it and what is wrong
    bad = {
        "shape [3, 1]": {"data": [1, 2, 3], "dtype": "int64", "shape": [3, 1]},
        "int64": {"data": [1.0, 2.0], "dtype": "float32", "shape": [2, 1]},
        "outside the vocabulary": {"data": [1, 10**7], "dtype": "int64", "shape": [2, 1]},
        "2 values": {"data": [1, 2], "dtype": "int64", "shape": [2, 2]},
        "row pointers": {
            "data": [1],
            "dtype": "int64",
            "shape": [2, 2],
            "sparse_crow_indices": [0, 2, 1],
            "sparse_col_indices": [0],
        },
    }
    for said, tensor in bad.items():
        body = {**sample, "seq_id": None, "target_prompt_logprobs": tensor}
        res = httpx.post(f"{url}/api/v1/asample", json=body, timeout=30)
        assert res.status_code == 400, (said, res.text)
        assert "target_prompt_logprobs" in res.text and said in res.text, (said, res.text)


def test_target_prompt_logprobs_are_bounded_in_what_an_engine_scores():
    """SGLang returns the union of the target tokens at every prompt position: a request whose
    union times positions (or whose cells) pass 2^20 is refused, naming both."""
    from orbit.serve import wire

    def one_each(n: int) -> wire.Targets:  # one token a position, each a different one
        return wire.targets(list(range(n)), [n, 1], list(range(n + 1)), [0] * n, n, 10**6)

    assert len(one_each(1000).cells) == 1000  # 1000 x 1000 <= 2^20
    with pytest.raises(wire.WireError, match="1100 distinct tokens at 1100 positions"):
        one_each(1100)
    with pytest.raises(wire.WireError, match="cells; at most 1048576"):
        wire.targets([1] * (2**20 + 1), [1, 2**20 + 1], None, None, 1, 10)
