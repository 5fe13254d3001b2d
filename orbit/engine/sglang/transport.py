"""How a call reaches SGLang. The engine (engine.py) is the same for both transports:

- `InProcessTransport`: an `sglang.Engine` in this process; every call is a coroutine of its
  tokenizer manager (`Engine`'s own synchronous methods block the loop and cannot overlap a running
  generation; pause/continue are not `Engine` methods in 0.5.23 at all);
- `HttpTransport` (http.py): an SGLang server's own routes.

Every coroutine runs on the engine's event loop. Outcomes are (success, SGLang's message).
"""

from __future__ import annotations

import signal
import threading
from typing import Protocol

import torch

from orbit.engine.sglang.gate import Outcome
from orbit.engine.sglang.local import ipc_files, remove, sglang_shm_files
from orbit.engine.sglang.process import close_zmq, kill_sglang, proc_name, sigquits


class Transport(Protocol):
    kind: str  # "in-process" | "http"
    # "in-process" | "local" (a server on this host) | "dir" (engine.adapter_dir)
    adapter_transport: str
    memory_saver: bool  # release/resume_memory free something
    attached: bool  # a server Orbit did not start: it stays up, with Orbit's adapters taken off it

    async def generate(self, body: dict) -> dict: ...

    async def pause(self, mode: str) -> None: ...

    async def resume(self) -> None: ...

    async def flush(self) -> Outcome: ...

    async def load_adapter(
        self, name: str, tensors: dict, config: dict, version: int
    ) -> Outcome: ...

    async def unload_adapter(self, name: str) -> Outcome: ...

    async def update_weights(
        self, named: list[tuple[str, torch.Tensor]], version: int
    ) -> Outcome: ...

    async def restore_weights(self, model_path: str) -> Outcome:
        """An attached server whose weights full pushes replaced: the checkpoint's again."""
        ...

    async def release_memory(self) -> None: ...

    async def resume_memory(self) -> None: ...

    async def dead(self) -> str | None:
        """Why SGLang is gone (None: alive). Polled every fraction of a second."""
        ...

    async def aclose(self) -> None:
        """Release what lives on the engine's loop (an HTTP client)."""
        ...

    def stop_server(self) -> None:
        """Kill a server Orbit started at once (a lost engine: nothing there to save)."""
        ...

    def close(self) -> None:
        """Stop what this transport started (only its own processes)."""
        ...


class InProcessTransport:
    """An `sglang.Engine` in this process (its scheduler and detokenizer in child processes)."""

    kind = "in-process"
    adapter_transport = "in-process"  # tensors handed to SGLang's own processes (file descriptors)
    attached = False

    def __init__(self, sgl_engine, memory_saver: bool, previous_sigquit) -> None:
        import psutil

        self._sgl = sgl_engine
        self._tm = sgl_engine.tokenizer_manager
        self.memory_saver = memory_saver
        self._previous_sigquit = previous_sigquit
        self._sigquits_at_start = len(sigquits)
        watchdog = getattr(self._tm, "_subprocess_watchdog", None)
        # SGLang's mp.Process children
        self._processes = list(getattr(watchdog, "_processes", []) or [])
        self.child_pids = list(sgl_engine.get_all_child_pids())
        self._procs = [psutil.Process(pid) for pid in self.child_pids]
        # Files SGLang leaves behind, noted now: a scheduler that dies takes the list of its own
        # along.
        self._files = sglang_shm_files(self.child_pids) + ipc_files(sgl_engine.port_args)

    async def generate(self, body: dict) -> dict:
        from sglang.srt.managers.io_struct import GenerateReqInput

        # what Engine.async_generate does, with the fields it does not pass (return_sampling_mask)
        return await self._tm.generate_request(GenerateReqInput(**body), None).__anext__()

    async def pause(self, mode: str) -> None:
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        await self._tm.pause_generation(PauseGenerationReqInput(mode=mode))

    async def resume(self) -> None:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        await self._tm.continue_generation(ContinueGenerationReqInput())

    async def flush(self) -> Outcome:
        res = await self._tm.flush_cache()
        return bool(res.success), str(getattr(res, "message", "") or "")

    async def load_adapter(self, name: str, tensors: dict, config: dict, version: int) -> Outcome:
        from sglang.srt.managers.io_struct import LoadLoRAAdapterFromTensorsReqInput

        # Serialized here, once per load: the payload is file-descriptor handles that the receiver
        # can fetch only once (sending the same bytes twice kills SGLang's scheduler).
        payload = self._sgl._serialize_tensors_per_rank(tensors, None)
        res = await self._tm.load_lora_adapter_from_tensors(
            LoadLoRAAdapterFromTensorsReqInput(
                lora_name=name, config_dict=config, serialized_named_tensors=payload
            ),
            None,
        )
        return bool(res.success), str(res.error_message or "")

    async def unload_adapter(self, name: str) -> Outcome:
        from sglang.srt.managers.io_struct import UnloadLoRAAdapterReqInput

        res = await self._tm.unload_lora_adapter(UnloadLoRAAdapterReqInput(lora_name=name), None)
        return bool(res.success), str(res.error_message or "")

    async def update_weights(self, named: list[tuple[str, torch.Tensor]], version: int) -> Outcome:
        from sglang.srt.managers.io_struct import (
            BeginWeightUpdateReqInput,
            EndWeightUpdateReqInput,
            UpdateWeightsFromTensorReqInput,
        )

        payload = self._sgl._serialize_tensors_per_rank(named, None)
        ok, msg = await self._tm.begin_weight_update(BeginWeightUpdateReqInput(), None)
        if not ok:
            return False, f"begin_weight_update: {msg}"
        try:
            ok, msg = (
                await self._tm.update_weights_from_tensor(
                    UpdateWeightsFromTensorReqInput(
                        serialized_named_tensors=payload,
                        load_format=None,
                        flush_cache=True,
                        weight_version=str(version),
                    ),
                    None,
                )
            )[:2]
        finally:
            end_ok, end_msg = await self._tm.end_weight_update(EndWeightUpdateReqInput(), None)
        return (ok and end_ok), str(msg if not ok else end_msg)

    async def restore_weights(self, model_path: str) -> Outcome:  # noqa: ARG002 - never attached
        return True, ""

    async def release_memory(self) -> None:
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

        await self._tm.release_memory_occupation(ReleaseMemoryOccupationReqInput(), None)

    async def resume_memory(self) -> None:
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        await self._tm.resume_memory_occupation(ResumeMemoryOccupationReqInput(), None)

    async def dead(self) -> str | None:
        import psutil

        gone = []
        for proc in self._procs:
            try:
                if proc.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                    gone.append(proc)
            except psutil.NoSuchProcess:
                gone.append(proc)
        if not gone:
            return None
        names = ", ".join(f"{proc_name(p)} (pid {p.pid})" for p in gone)
        note = (
            " after signalling a failure (SIGQUIT)"
            if len(sigquits) > self._sigquits_at_start
            else ""
        )
        return f"SGLang process {names} died{note}; the engine is dead"

    async def aclose(self) -> None:
        pass  # nothing on the loop: the engine's processes go in close()

    def stop_server(self) -> None:
        pass  # no server: close() kills SGLang's own processes

    def close(self) -> None:
        """Kill SGLang's own process tree (not `Engine.shutdown()`: that kills every child of this
        process)."""
        watchdog = getattr(self._tm, "_subprocess_watchdog", None)
        if watchdog is not None:
            watchdog.stop()  # it would SIGQUIT this process when it sees the children go
        kill_sglang(self.child_pids, self._processes)
        remove(self._files)
        # SGLang's ZeroMQ sockets default to an infinite linger: with a message still queued for a
        # dead peer, garbage-collecting their context would block this process forever.
        close_zmq(self._sgl, self._tm)
        self._sgl.send_to_rpc = None
        try:
            self._tm.cuda_vmm_feature_transport.shutdown()
        except Exception:  # noqa: BLE001 - optional cleanup of SGLang's own
            pass
        if (
            self._previous_sigquit is not None
            and threading.current_thread() is threading.main_thread()
        ):
            signal.signal(signal.SIGQUIT, self._previous_sigquit)
