"""`orbit serve` as a service people share (docs/tinker.md, "Running it for a team"): keys and
tenants that cannot reach one another's things by any route, bad input that hurts only its sender,
and restarts that lose nothing a client was told, through the real `tinker` SDK (make tinker) and
raw HTTP for what the SDK would never send."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from safetensors.torch import load_file
from tinker_helpers import ROOT, sdk, sdk_env, sdk_python, serving

from orbit.serve import tinker_pb2 as pb
from orbit.serve.command import Options
from orbit.serve.keys import LOCAL, Keys, read_keys, tenant_of
from orbit.serve.service import Quotas

pytestmark = pytest.mark.slow

KEY_A, KEY_B = "tml-tenant-a-4b1f", "tml-tenant-b-90c2"
SERVICE = Path(__file__).resolve().parent / "tinker" / "sdk_service.py"
SLOW_SERVE = Path(__file__).resolve().parent / "tinker" / "slow_serve.py"


@pytest.fixture(scope="module")
def shared(tiny_llama, tmp_path_factory):
    """One service with two keys, and what key A made in it."""
    keys_file = tmp_path_factory.mktemp("keys") / "keys"
    keys_file.write_text(f"# two tenants\n{KEY_A}\n\n{KEY_B}\n")
    # the SDK scripts leave their sessions open (their clients are read after they end): a long
    # timeout, so that a slow machine's module run does not outlast it
    options = Options(keys=read_keys(keys_file), quotas=Quotas(session_timeout_s=3600))
    with serving(tiny_llama, tmp_path_factory.mktemp("serve-shared"), options) as (url, service):
        made = sdk(url, tiny_llama, "owner", key=KEY_A, script=SERVICE)
        yield url, service, tiny_llama, made


def _post(url: str, route: str, key: str | None, **kw) -> httpx.Response:
    headers = {"X-API-Key": key} if key else {}
    return httpx.post(f"{url}/api/v1/{route}", headers=headers, timeout=30, **kw)


def test_keys_are_required_and_never_kept(shared, tmp_path):
    url, service, _, _ = shared
    for key, why in ((None, "X-API-Key: one is required"), ("tml-wrong", "a key this orbit")):
        res = _post(url, "create_session", key, json={})
        assert res.status_code == 401 and why in res.json()["detail"], res.text
    assert httpx.get(f"{url}/api/v1/healthz", timeout=10).status_code == 200
    database = b"".join(p.read_bytes() for p in service.directory.glob("orbit-serve.db*"))
    assert KEY_A.encode() not in database and tenant_of(KEY_A).encode() in database
    bad = tmp_path / "bad-keys"
    bad.write_text("tml-ok\nnot a key\n")
    with pytest.raises(ValueError, match="line 2"):
        read_keys(bad)
    assert Keys().tenant(None) == "local"  # no keys file: one tenant, any key


def test_a_tenant_cannot_reach_anothers_things_by_any_route(shared):
    url, service, model, a = shared
    seen = sdk(url, model, "intruder", key=KEY_B, script=SERVICE, arg=json.dumps(a))
    assert a["model_id"] not in seen["runs"] and seen["own_run"] in seen["runs"]
    assert not any(p.startswith(f"tinker://{a['model_id']}") for p in seen["checkpoints"])
    for attempt in ("get_run", "run_checkpoints", "weights_info", "delete", "sample_path"):
        assert "NotFound" in seen[attempt] or "404" in seen[attempt], (attempt, seen[attempt])
    for attempt in ("load_state", "from_state"):
        assert "no checkpoint" in seen[attempt], (attempt, seen[attempt])
    # what the SDK would never send: key A's ids in key B's requests, each a clean 404
    session = a["model_id"].split(":")[0]
    guesses = {
        "session_heartbeat": {"session_id": session},
        "get_info": {"model_id": a["model_id"]},
        "optim_step": {"model_id": a["model_id"], "seq_id": 99},
        "save_weights": {"model_id": a["model_id"], "path": "stolen"},
        "create_sampling_session": {
            "session_id": session,
            "sampling_session_seq_id": 9,
            "model_path": a["sampler_path"],
        },
        "asample": {
            "sampling_session_id": a["sampler_id"],
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
        },
        "retrieve_future": {"request_id": "req-1"},
    }
    for route, body in guesses.items():
        res = _post(url, route, KEY_B, json=body)
        assert res.status_code == 404 and "\n" not in res.json()["detail"], (route, res.text)
    for path in (f"training_runs/{a['model_id']}", f"samplers/{a['sampler_id']}"):
        res = httpx.get(f"{url}/api/v1/{path}", headers={"X-API-Key": KEY_B}, timeout=10)
        assert res.status_code == 404, (path, res.text)
    # and key A's things are all still there
    assert service.checkpoint(tenant_of(KEY_A), a["state"]).directory.is_dir()
    assert len(service.checkpoints.of(tenant_of(KEY_A))) == 2


def test_a_published_checkpoint_is_read_by_other_tenants_and_kept_by_its_own(shared):
    """Key A publishes a state and a sampler's weights: key B samples the one and makes a client
    from the other, but cannot delete them, set their TTL or take the publishing back; once A
    takes it back, B is refused again. B's own listing never shows A's checkpoints."""
    url, service, model, _ = shared
    a = sdk(url, model, "publisher", key=KEY_A, script=SERVICE, arg="publish")
    assert a["listed"] == [True, True]
    seen = sdk(url, model, "reader", key=KEY_B, script=SERVICE, arg=json.dumps(a))
    for allowed in ("sample_path", "from_state", "weights_info"):
        assert seen[allowed] == "served", (allowed, seen[allowed])
    for kept in ("delete", "unpublish", "ttl"):
        assert "NotFound" in seen[kept] or "404" in seen[kept], (kept, seen[kept])
    assert not any(p.startswith(f"tinker://{a['model_id']}") for p in seen["listed"])
    assert sdk(url, model, "publisher", key=KEY_A, script=SERVICE, arg=json.dumps(a))["listed"] == [
        False,
        False,
    ]
    again = sdk(url, model, "reader", key=KEY_B, script=SERVICE, arg=json.dumps(a))
    for refused in ("sample_path", "from_state", "weights_info"):
        assert "NotFound" in again[refused] or "no checkpoint" in again[refused], (
            refused,
            again[refused],
        )
    assert service.checkpoint(tenant_of(KEY_A), a["state"]).directory.is_dir()


def _fb_body(model_id: str, tokens: list[int], loss: str = "cross_entropy", **inputs) -> bytes:
    def tensor(values: list[float], dtype=pb.DTYPE_FLOAT32) -> pb.Tensor:
        kind = torch.float32 if dtype == pb.DTYPE_FLOAT32 else torch.int64
        raw = torch.tensor(values, dtype=kind).numpy().tobytes()
        return pb.Tensor(dtype=dtype, shape=[len(values)], dense=raw)

    targets = inputs.pop("targets", tokens[1:] + [tokens[0]])
    loss_inputs = {"target_tokens": tensor(targets, pb.DTYPE_INT64)}
    for name, values in inputs.items():
        loss_inputs[name] = tensor(values)
    datum = pb.Datum(loss_fn_inputs=loss_inputs)
    chunk = datum.model_input.add()
    chunk.encoded_text.tokens = torch.tensor(tokens, dtype=torch.int32).numpy().tobytes()
    return pb.ForwardBackwardRequest(
        model_id=model_id, seq_id=0, loss_fn=loss, data=[datum]
    ).SerializeToString()


def test_bad_input_hurts_only_its_sender(shared):
    """Each malformed request gets a 4xx with one line naming what was wrong; the service and key
    A's client go on, its adapter and optimizer unchanged."""
    url, service, _, a = shared
    tenant = tenant_of(KEY_A)
    trainer = service.client(tenant, a["model_id"])
    weights = trainer.adapter()[0]
    optimizer = {k: v.clone() for k, v in _optimizer_tensors(trainer).items()}
    mid, n = a["model_id"], 6
    tokens = list(range(1, n + 1))
    ones = [1.0] * n
    fb = "forward_backward"
    cases = {
        "malformed protobuf": (fb, {"content": b"\x0a\xff\xff\xff not a message"}, "protocol"),
        "malformed JSON": ("optim_step", {"content": b"{not json"}, "not JSON"),
        "JSON not an object": ("optim_step", {"json": [1, 2]}, "not a JSON object"),
        "unknown loss": (fb, {"content": _fb_body(mid, tokens, "custom", weights=ones)}, "custom"),
        "mismatched lengths": (
            fb,
            {"content": _fb_body(mid, tokens, weights=[1.0] * (n - 1))},
            "weights",
        ),
        "token outside the vocabulary": (
            fb,
            {"content": _fb_body(mid, [*tokens[:-1], 10**6], weights=ones)},
            "outside the vocabulary",
        ),
        "non-finite advantage": (
            fb,
            {
                "content": _fb_body(
                    mid,
                    tokens,
                    "importance_sampling",
                    logprobs=[-1.0] * n,
                    advantages=[float("nan")] * n,
                )
            },
            "not finite",
        ),
        "empty batch": (
            fb,
            {
                "content": pb.ForwardBackwardRequest(
                    model_id=mid, loss_fn="cross_entropy"
                ).SerializeToString()
            },
            "no datums",
        ),
        "non-finite learning rate": (
            "optim_step",
            {"json": {"model_id": mid, "adam_params": {"learning_rate": float("inf")}}},
            "not finite",
        ),
        "max_tokens past the context": (
            "asample",
            {
                "json": {
                    "sampling_session_id": a["sampler_id"],
                    "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                    "sampling_params": {"max_tokens": 10**6},
                }
            },
            "context",
        ),
        "body past the size limit": (fb, {"content": b"\0" * (65 * 2**20)}, "at most"),
        "unknown model": ("get_info", {"json": {"model_id": "nobody:train:0"}}, "no training"),
        "unknown sampler": (
            "asample",
            {
                "json": {
                    "sampling_session_id": "nobody:sample:0",
                    "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1]}]},
                }
            },
            "no sampling session",
        ),
        "a path that is not a checkpoint": (
            "weights_info",
            {"json": {"tinker_path": "tinker://../../etc/passwd"}},
            "not a checkpoint path",
        ),
    }
    for name, (route, send, says) in cases.items():
        if "json" in send and isinstance(send["json"], dict):  # keep inf and nan as JSON numbers
            send = {"content": json.dumps(send["json"]).encode()}
        res = _post(url, route, KEY_A, **send)
        detail = res.json().get("detail", "")
        assert 400 <= res.status_code < 500, (name, res.status_code, res.text)
        assert says in detail and "\n" not in detail, (name, detail)
    assert httpx.get(f"{url}/api/v1/healthz", timeout=10).status_code == 200
    after = trainer.adapter()[0]
    assert all(torch.equal(after[k], v) for k, v in weights.items())
    assert all(torch.equal(_optimizer_tensors(trainer)[k], v) for k, v in optimizer.items())
    # the client goes on: its next request (numbered after the refused ones) runs at once
    again = sdk(url, service.bases[0].model, "owner", key=KEY_A, script=SERVICE)
    assert again["model_id"] != a["model_id"]


@pytest.mark.timeout(400)
def test_eight_training_clients_and_eight_samplers_all_progress(shared):
    """16 clients at once on one base: all finish, none waits long for any request (the trainer's
    turns go round among the clients with a request ready: tests/test_serve_turns.py)."""
    url, service, model, _ = shared
    spec = {"clients": 8, "samplers": 8, "steps": 3}
    seen = sdk(url, model, "load", key=KEY_A, script=SERVICE, arg=json.dumps(spec), timeout=380)
    clients = seen["clients"]
    assert len(clients) == 16 and all("finished_s" in c for c in clients.values()), clients
    waits = [x for c in clients.values() for k in ("forward_backward", "optim_step", "asample")
             for x in c.get(k, [])]  # fmt: skip
    assert len(waits) == 8 * 3 * 2 + 8 * 3 and max(waits) < 30, max(waits)
    assert all(len(c["asample"]) == 3 for n, c in clients.items() if n.startswith("sample"))
    # clients with a forward_backward ready at once shared passes over the base (packs)
    packs = list(service.turns.packs)
    assert max(p.clients for p in packs) > 1, packs
    assert all(p.tokens <= service.turns.pack_tokens or p.clients == 1 for p in packs)
    print(
        f"\n16 clients, 3 steps each: {seen['seconds']:.1f} s, longest request {max(waits):.2f} s, "
        f"{len(packs)} packs of {max(p.clients for p in packs)} requests at most"
    )


def test_past_its_limits_a_key_is_refused_with_a_429_the_sdk_raises(shared):
    url, service, model, _ = shared
    held = service.store.live_clients(tenant_of(KEY_B))
    quotas = service.quotas
    service.quotas = dataclasses.replace(quotas, max_clients=held + 2)
    try:
        seen = sdk(url, model, "crowd", key=KEY_B, script=SERVICE, arg="10")
    finally:
        service.quotas = quotas
    assert seen["made"] == 2 and "RateLimitError" in seen["refused"], seen
    assert "holds" in seen["refused"] and "--max-clients" in seen["refused"]
    # the limit is the key's: key A still creates clients
    assert sdk(url, model, "owner", key=KEY_A, script=SERVICE)["model_id"]


# ---- clients that end -------------------------------------------------------------------------


def _future(url: str, key: str, answer: httpx.Response) -> dict:
    assert answer.status_code == 200, answer.text
    res = _post(url, "retrieve_future", key, json={"request_id": answer.json()["request_id"]})
    assert res.status_code == 200, res.text
    return res.json()


def test_a_session_that_ends_releases_its_clients_and_keeps_their_checkpoints(shared):
    """Closed by its client (`ServiceClient.close`, or a `with` block's end): its training client
    and snapshot sampler are released, each call to them a 410 naming why, its heartbeat a 410; its
    saved state stays and continues in a client of another session, which `unload_model` releases
    after what it queued. Only live clients count against the key's limit."""
    url, service, model, _ = shared
    tenant = tenant_of(KEY_A)
    live = service.store.live_clients(tenant)
    seen = sdk(url, model, "ends", key=KEY_A, script=SERVICE, arg=url)
    res = _post(url, "get_info", KEY_A, json={"model_id": seen["model_id"]})
    assert res.status_code == 410, res.text
    assert "its session ended: finished by its client (success)" in res.json()["detail"]
    assert seen["state"] in res.json()["detail"]  # where to continue from
    assert seen["model_id"] not in service.live()
    session = seen["model_id"].split(":")[0]
    assert _post(url, "session_heartbeat", KEY_A, json={"session_id": session}).status_code == 410
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]}
    body = {"sampling_session_id": seen["sampler_id"], "prompt": prompt, "num_samples": 1}
    assert _post(url, "asample", KEY_A, json=body).status_code == 404
    assert service.checkpoint(tenant, seen["state"]).directory.is_dir()
    assert service.store.live_clients(tenant) == live + 1  # the one made again from the state
    done = _future(url, KEY_A, _post(url, "unload_model", KEY_A, json={"model_id": seen["again"]}))
    assert done == {"model_id": seen["again"], "type": "unload_model"}, done
    res = _post(url, "get_info", KEY_A, json={"model_id": seen["again"]})
    assert res.status_code == 410 and "unloaded (unload_model)" in res.json()["detail"], res.text
    assert service.store.live_clients(tenant) == live
    # another tenant cannot unload it, nor finish its session
    assert _post(url, "unload_model", KEY_B, json={"model_id": seen["again"]}).status_code == 404
    assert _post(url, f"sessions/{session}/finish", KEY_B, json={}).status_code == 404


def test_a_session_whose_heartbeat_stops_is_ended_and_one_that_beats_lives(tiny_llama, tmp_path):
    options = Options(quotas=Quotas(session_timeout_s=1.5))
    with serving(tiny_llama, tmp_path, options) as (url, service):
        made = {}
        for name in ("silent", "beating"):
            session = _post(url, "create_session", "tml-local", json={}).json()["session_id"]
            body = {"session_id": session, "model_seq_id": 0, "base_model": str(tiny_llama)}
            answer = _post(url, "create_model", "tml-local", json=body)
            made[name] = _future(url, "tml-local", answer)
            made[name]["session"] = session
        deadline = time.monotonic() + 60
        while made["silent"]["model_id"] in service.live() and time.monotonic() < deadline:
            beat = {"session_id": made["beating"]["session"]}
            assert _post(url, "session_heartbeat", "tml-local", json=beat).status_code == 200
            time.sleep(0.3)
        res = _post(url, "get_info", "tml-local", json={"model_id": made["silent"]["model_id"]})
        assert res.status_code == 410 and "no heartbeat for 1.5 s" in res.json()["detail"], res.text
        assert made["beating"]["model_id"] in service.live()


def test_memory_stays_flat_over_200_clients_created_and_released(tiny_llama, tmp_path):
    """Each client trains a step (adapter, gradients, Adam state) and is released; the service's
    memory after 200 is within 10% of its memory after the first 16, and the base holds no adapter
    of theirs."""
    import gc

    from orbit.serve.clients import AdamParams, LoraSpec
    from orbit.serve.wire import Datum

    tokens = [1, 5, 9, 13, 17, 21, 25, 29]
    targets = torch.tensor(tokens[1:] + [3])
    datum = Datum(tokens, {"target_tokens": targets, "weights": torch.ones(len(tokens))})
    with serving(tiny_llama, tmp_path) as (_, service):
        session = service.create_session(LOCAL, {})
        rss = {}
        for n in range(1, 201):
            spec = LoraSpec(rank=64, seed=n)
            made = service.create_model(LOCAL, session, n, str(tiny_llama), spec, {})
            model_id = made.future.result(60)["model_id"]
            trainer = service.client(LOCAL, model_id)
            trainer.forward_backward([datum], "cross_entropy", {}, False)
            trainer.optim_step(AdamParams(learning_rate=1e-3))
            service.unload_model(LOCAL, model_id).future.result(60)
            if n in (16, 200):
                gc.collect()
                rss[n] = psutil.Process().memory_info().rss
        mib = {n: f"{v / 2**20:.1f} MiB" for n, v in rss.items()}
        print(f"\nRSS after 16 clients released: {mib[16]}, after 200: {mib[200]}")
        assert rss[200] <= 1.10 * rss[16]
        assert list(service.bases[0].shared.model.peft_config) == []
        assert service.live() == {}


def _optimizer_tensors(trainer) -> dict[str, torch.Tensor]:
    state = trainer.optimizer.state_dict()["state"]
    return {f"{i}.{k}": v for i, s in state.items() for k, v in s.items() if torch.is_tensor(v)}


# ---- restarts ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`orbit serve` as its own process (slowed where `slow` says: tests/tinker/slow_serve.py)."""

    def __init__(self, recipe: Path, directory: Path, port: int, slow: str) -> None:
        args = [sys.executable, str(SLOW_SERVE), slow, "serve", str(recipe)]
        args += ["--port", str(port), "--dir", str(directory)]
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env={**os.environ, "COLUMNS": "200"},
            start_new_session=True,  # a process group of its own, to kill whole
        )
        self.lines: list[str] = []
        self.wait_for("serving the Tinker API", 120)

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                break
            self.lines.append(line)
            if text in line:
                return
        raise AssertionError(f"no {text!r} from orbit serve:\n{''.join(self.lines)[-3000:]}")

    def kill(self) -> list[psutil.Process]:
        """SIGKILL, as the OOM killer would; what it started, to check that it goes too."""
        children = psutil.Process(self.proc.pid).children(recursive=True)
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        return children

    def kill_group(self) -> list[psutil.Process]:
        """SIGKILL to its whole process group (the resource tracker and the engines with it)."""
        children = psutil.Process(self.proc.pid).children(recursive=True)
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        return children

    def shm(self) -> set[str]:
        """What its processes have open in /dev/shm, read from their memory maps."""
        procs = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(True)]
        found = set()
        for proc in procs:
            try:
                maps = Path(f"/proc/{proc.pid}/maps").read_text()
            except OSError:
                continue
            found |= {x.split()[-1] for x in maps.splitlines() if "/dev/shm/" in x}
        return {f for f in found if not f.endswith("(deleted)")}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def _driver(url: str, model: Path, step: str, arg: str = "") -> subprocess.Popen:
    return subprocess.Popen(
        [str(sdk_python()), str(SERVICE), url, str(model), step, *([arg] if arg else [])],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=sdk_env("tml-local"),
    )


def _result(driver: subprocess.Popen, timeout: float = 180) -> dict:
    out = driver.communicate(timeout=timeout)[0]
    lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
    assert driver.returncode == 0 and lines, out[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def _gone(children: list[psutil.Process]) -> None:
    _, alive = psutil.wait_procs(children, timeout=20)
    assert not alive, f"left running after orbit serve was killed: {alive}"


@pytest.mark.timeout(300)
def test_a_kill_of_the_whole_process_group_leaves_nothing_after_the_next_start(
    tiny_llama, tmp_path
):
    """kill -9 of orbit serve's process group kills multiprocessing's resource tracker too, so the
    named semaphores of its engine's queue stay in /dev/shm; the next start removes them."""
    recipe = tmp_path / "serve.yaml"
    recipe.write_text(json.dumps({"model": str(tiny_llama), "engine": {"backend": "embedded"}}))
    directory, port = tmp_path / "serve", _free_port()
    server = Server(recipe, directory, port, "none")
    try:
        held = server.shm()
        assert any("/sem.mp-" in f for f in held), held  # what the kill will leave
        _gone(server.kill_group())
        assert all(Path(f).exists() for f in held)  # left by the kill
        server = Server(recipe, directory, port, "none")
        assert not [f for f in held if Path(f).exists()]
    finally:
        server.stop()


@pytest.mark.timeout(600)
def test_kill_mid_step_and_mid_save_then_continue_exactly(tiny_llama, tmp_path):
    """kill -9 in an optim_step, start again, a new client from the saved state continues; kill -9
    in a save over a checkpoint, start again: the old checkpoint stands. Each future the kill ended
    fails with the reason (none hangs), and the run equals one never killed (1e-6)."""
    recipe = tmp_path / "serve.yaml"
    recipe.write_text(json.dumps({"model": str(tiny_llama), "engine": {"backend": "embedded"}}))
    directory, port = tmp_path / "serve", _free_port()
    url = f"http://127.0.0.1:{port}"
    server = Server(recipe, directory, port, "optim")
    try:
        driver = _driver(url, tiny_llama, "before_kill")
        server.wait_for("OPTIM_STEP_RUNNING", 120)
        server.wait_for("POLLED", 60)  # the SDK holds the request's id (tinker/slow_serve.py)
        _gone(server.kill())
        server = Server(recipe, directory, port, "save")
        first = _result(driver)
        assert "restarted while this request ran" in first["lost"], first

        driver = _driver(url, tiny_llama, "resume_then_kill", first["state"])
        server.wait_for("SAVE_RUNNING", 120)
        server.wait_for("POLLED", 60)
        _gone(server.kill())
        server = Server(recipe, directory, port, "none")
        second = _result(driver)
        assert "restarted while this request ran" in second["lost"], second

        final = _result(_driver(url, tiny_llama, "after"))
    finally:
        server.stop()
    assert {first["state"], second["latest"]} <= set(final["checkpoints"])

    def saved(path: str) -> Path:
        return directory / "checkpoints" / path.removeprefix("tinker://")

    latest, ref = saved(second["latest"]), saved(final["ref"])
    assert not [p for p in latest.parent.iterdir() if p.name.startswith(".")]  # nothing half done
    want, got = (
        load_file(ref / "adapter_model.safetensors"),
        load_file(latest / "adapter_model.safetensors"),
    )
    assert max(float((want[k] - got[k]).abs().max()) for k in want) < 1e-6
    opt_want = torch.load(ref / "optimizer.pt", weights_only=True)["state"]
    opt_got = torch.load(latest / "optimizer.pt", weights_only=True)["state"]
    for i, s in opt_want.items():
        for k, v in s.items():
            assert float((torch.as_tensor(v) - torch.as_tensor(opt_got[i][k])).abs().max()) < 1e-6


def test_the_services_page_shows_clients_engines_and_latency_and_no_key(shared):
    from browser import browser

    from orbit.serve.page import watch

    url, service, _, a = shared
    # an inflight save of A's client, unnumbered (after what it queued): a target on the page
    saved = service.save_for_sampler(tenant_of(KEY_A), a["model_id"], 0, None, 77, "inflight")
    saved.future.result(60)
    page_server = watch(service)
    try:
        with browser() as page:
            page.goto(page_server.url)
            page.wait_for_function(
                f"document.querySelector('#clients tbody').textContent.includes('{a['model_id']}')",
                timeout=15_000,
            )
            text = page.content()
            rows = page.locator("#requests tbody tr").all_inner_texts()
            assert any(r.startswith("ForwardBackward") for r in rows), rows
            assert page.locator("#losses .main-svg").count() > 0  # the loss chart is drawn
            assert page.locator("#engines tbody tr").count() == len(service.bases[0].sampler.caches)
            targets = page.locator("#targets tbody tr").all_inner_texts()
            assert any(a["model_id"] in t and "\t1\t" in t for t in targets), targets
            packs = page.locator("#packsum tbody tr").all_inner_texts()
            assert int(packs[0].split("\t")[0]) == len(service.turns.packs) > 0, packs
            assert page.locator("#packs .main-svg").count() > 0
    finally:
        page_server.stop()
    assert tenant_of(KEY_A) in text and KEY_A not in text and KEY_B not in text
