"""The HTTP transport: an SGLang 0.5.23 server's own routes (`python -m sglang.launch_server`).

| protocol call | route |
|---|---|
| generate / score | POST /generate (GenerateReqInput as JSON, `lora_path` = the slot's name) |
| pause / continue | POST /pause_generation {mode} / POST /continue_generation |
| flush_cache | POST /flush_cache (400 while requests run) |
| load_adapter | the adapter written in peft's format, POST /load_lora_adapter {lora_path} |
| unload | POST /unload_lora_adapter |
| update_weights | the weights written as safetensors, POST /update_weights_from_disk |
| release / resume_memory | POST /release_memory_occupation, /resume_memory_occupation |
| liveness, start-up checks | GET /health, /model_info, /server_info; POST /get_weights_by_name |

A started server that does not answer /health is hung only if its processes spend no CPU meanwhile
(working.py): a long prefill holds /health until it ends. Every call has a timeout. Only idempotent
reads (GET) are retried; a POST that fails is reported, never sent twice (a second `generate` would
sample twice, a second load could load twice). The API key goes in the Authorization header and
nowhere else: it is never written to the run directory or the log, and messages that quote the
server are scrubbed of it.

Adapters travel as files. To a server on this host they go through a directory of Orbit's own in
/dev/shm (local.py); to servers elsewhere through `engine.adapter_dir`, a directory both sides read.
Each load writes a fresh directory (atomically: written aside, then renamed), and the one a slot
held before is deleted once the slot is rewritten. Full weights go the same way (one safetensors
file of the weights to replace, deleted once the server has read it). No pickle and no shared-memory
handle is ever sent to a server, on this host or elsewhere.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import httpx
import torch

from orbit.engine.base import EngineDeadError, EngineError
from orbit.engine.sglang import local
from orbit.engine.sglang.adapters import write_peft_dir, write_weights_dir
from orbit.engine.sglang.gate import Outcome
from orbit.engine.sglang.working import MAX_BUSY_S, HealthWatch
from orbit.host.secret import scrub

GET_RETRIES = 3
# a server that does not answer /health this fast is hung, unless Orbit started it and its
# processes are at work (working.py): a long batch holds /health until it ends
PROBE_TIMEOUT_S = 5.0


class HttpTransport:
    kind = "http"

    def __init__(
        self,
        url: str,
        api_key: str | None,
        adapter_dir: Path | None,
        timeout_s: float,
        memory_saver: bool = False,
        label: str = "",
        server=None,
        max_connections: int = 256,
    ) -> None:
        """`adapter_dir`: a directory the server reads too (another host); None: a server on this
        host, reached through a directory of Orbit's own (local.py), removed at close."""
        self.url = url.rstrip("/")
        self.label = label or f"SGLang server {self.url}"
        self._key = api_key
        self.adapter_transport = "dir" if adapter_dir is not None else "local"
        self._owned = adapter_dir is None
        self.adapter_dir = adapter_dir if adapter_dir is not None else local.adapter_root()
        self.memory_saver = memory_saver
        self.timeout_s = timeout_s
        self.server = server  # the ServerProcess Orbit started (None: attached, left running)
        self._health: HealthWatch | None = None  # its liveness (made on the loop, at first use)
        self.attached = server is None
        self._max_connections = max_connections
        self._client: httpx.AsyncClient | None = None
        self._dirs: dict[str, Path] = {}  # adapter name -> the directory it was loaded from

    # ---- plumbing ------------------------------------------------------------------------------

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:  # created on the engine's loop, where it is used
            headers = {"Authorization": f"Bearer {self._key}"} if self._key else {}
            self._client = httpx.AsyncClient(
                base_url=self.url,
                headers=headers,
                timeout=httpx.Timeout(self.timeout_s, connect=PROBE_TIMEOUT_S),
                limits=httpx.Limits(
                    max_connections=self._max_connections, max_keepalive_connections=64
                ),
            )
        return self._client

    def scrub(self, text: str) -> str:
        return scrub(text, self._key)

    async def _post(
        self, route: str, body: dict | None = None, timeout: float | None = None
    ) -> httpx.Response:
        """One POST, never retried. A broken connection is a dead server when the server says so
        (EngineDeadError: the pool moves its requests to the others), else this call's failure."""
        try:
            return await self._http().post(
                route, json=body or {}, timeout=timeout or self.timeout_s
            )
        except httpx.TransportError as e:
            reason = await self._gone()
            if reason is not None:
                raise EngineDeadError(f"{self.label}: {reason}") from None
            raise EngineError(f"{self.label}: {route} failed: {type(e).__name__}: {e}") from None

    async def _get(self, route: str, timeout: float | None = None) -> httpx.Response:
        """A GET, retried on connection errors and 5xx (reads are idempotent)."""
        for attempt in range(GET_RETRIES):
            try:
                res = await self._http().get(route, timeout=timeout or self.timeout_s)
                if res.status_code < 500 or attempt == GET_RETRIES - 1:
                    return res
            except httpx.TransportError:
                if attempt == GET_RETRIES - 1:
                    raise
            await asyncio.sleep(0.2 * (attempt + 1))
        raise AssertionError("unreachable")

    def _outcome(self, res: httpx.Response) -> Outcome:
        if res.status_code == 200:
            try:
                body = res.json()
            except ValueError:
                return True, ""
            if isinstance(body, dict) and body.get("success") is False:
                return False, self.scrub(
                    str(body.get("error_message") or body.get("message") or body)
                )
            return True, ""
        return False, self.scrub(f"HTTP {res.status_code}: {res.text[:500]}")

    # ---- the protocol's calls ------------------------------------------------------------------

    async def generate(self, body: dict) -> dict:
        res = await self._post("/generate", body)
        if res.status_code != 200:
            raise ValueError(self.scrub(f"HTTP {res.status_code}: {res.text[:500]}"))
        return res.json()

    async def _must(self, route: str, body: dict | None = None) -> None:
        """A control call the engine cannot go on without: a refusal raises, naming the route."""
        ok, message = self._outcome(await self._post(route, body))
        if not ok:
            raise RuntimeError(f"{self.label}: {route.lstrip('/')} refused: {message}")

    async def pause(self, mode: str) -> None:
        await self._must("/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._must("/continue_generation")

    async def flush(self) -> Outcome:
        return self._outcome(await self._post("/flush_cache"))

    async def load_adapter(self, name: str, tensors: dict, config: dict, version: int) -> Outcome:
        path = write_peft_dir(self.adapter_dir, f"{name}-v{version}", tensors, config)
        ok, message = self._outcome(
            await self._post("/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        )
        if not ok:
            shutil.rmtree(path, ignore_errors=True)
            return ok, message
        old, self._dirs[name] = self._dirs.get(name), path
        # the version this slot held before: no slot uses it any more
        if old is not None and old != path:
            shutil.rmtree(old, ignore_errors=True)
        return ok, message

    async def unload_adapter(self, name: str) -> Outcome:
        return self._outcome(await self._post("/unload_lora_adapter", {"lora_name": name}))

    async def update_weights(self, named: list[tuple[str, torch.Tensor]], version: int) -> Outcome:
        path = write_weights_dir(self.adapter_dir, f"weights-v{version}", named)
        try:
            return self._outcome(
                await self._post(
                    "/update_weights_from_disk",
                    {
                        "model_path": str(path),
                        "load_format": "safetensors",
                        "flush_cache": True,
                        "weight_version": str(version),
                    },
                )
            )
        finally:
            shutil.rmtree(path, ignore_errors=True)  # answered: the server has read it (or refused)

    async def restore_weights(self, model_path: str) -> Outcome:
        return self._outcome(
            await self._post(
                "/update_weights_from_disk",
                {"model_path": model_path, "flush_cache": True, "weight_version": "0"},
            )
        )

    async def release_memory(self) -> None:
        await self._must("/release_memory_occupation")

    async def resume_memory(self) -> None:
        await self._must("/resume_memory_occupation")

    async def _gone(self) -> str | None:
        """After a broken connection, asked at once (not at the watch's next look): its process
        exited or it cannot be reached is death; a /health that times out gets the watch's verdict
        (slow is not hung)."""
        if self.server is not None and self.server.exited() is not None:
            return await self.dead()
        try:
            await self._http().get("/health", timeout=PROBE_TIMEOUT_S)
        except httpx.TimeoutException:
            return await self.dead()
        except httpx.TransportError as e:
            return f"cannot be reached ({type(e).__name__}: {e})"
        return None

    async def dead(self) -> str | None:
        if self.server is not None and self.server.exited() is not None:
            return (
                f"its process {self.server.pid} exited (code {self.server.exited()}); "
                f"{self.server.log_tail()}"
            )
        if self._health is None:
            # the request's own bound past the watch's, whose verdict says more
            ask = lambda: self._http().get("/health", timeout=MAX_BUSY_S + 60)  # noqa: E731
            pid = self.server.pid if self.server is not None else None
            self._health = HealthWatch(ask, pid, PROBE_TIMEOUT_S)
        return await self._health.check()

    async def aclose(self) -> None:
        if self._health is not None:
            self._health.close()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def stop_server(self) -> None:
        """SIGKILL the server's process group if Orbit started it; an attached one stays."""
        if self.server is not None:
            self.server.stop()

    def close(self) -> None:
        """Stop the server if Orbit started it (its own process group); an attached one stays. The
        adapters written for it go (Orbit's own directory whole)."""
        self.stop_server()
        for path in self._dirs.values():
            shutil.rmtree(path, ignore_errors=True)
        self._dirs.clear()
        if self._owned:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)
