"""The SGLang backends (sglang 0.5.23): Orbit's engine protocol on SGLang, in this process
(`engine.backend: sglang`, an `sglang.Engine`) or over HTTP (`engine.backend: sglang-server`,
servers Orbit starts or attaches to).

| module         | one job                                                                     |
|----------------|-----------------------------------------------------------------------------|
| `engine.py`    | the protocol: requests, slots, pushes, accounting, liveness, shutdown        |
| `requests.py`  | one request's checks and fields, and reading SGLang's reply                 |
| `gate.py`      | the slot gate: which adapter each slot holds, when it may be rewritten      |
| `adapters.py`  | adapter checks and conversion; the peft directory for other hosts            |
| `transport.py` | how calls reach SGLang: the in-process tokenizer manager                     |
| `http.py`      | ... or a server's routes                                                     |
| `process.py`   | starting and stopping the in-process engine (CPU shims, signals, ZeroMQ)     |
| `forked.py`    | ... on a CPU, its processes forked from Orbit's fork server, SGLang imported |
| `server.py`    | starting, attaching to and checking servers                                 |
| `launch.py`    | a started server's entry point: it stops with the Orbit that started it      |
| `local.py`     | files of this host's servers: the adapter directory in /dev/shm, clean-up     |
| `event_loop.py`| the event loop every call to SGLang runs on, and its liveness watchdog       |
| `working.py`   | whether a started server's processes are at work (slow, not hung)            |
| `install.py`   | whether sglang 0.5.23 is installed here, and how to install it               |
"""

from __future__ import annotations

from pathlib import Path

from orbit.engine.sglang.engine import SGLangEngine
from orbit.engine.sglang.gate import slot_name
from orbit.engine.sglang.process import ALL_TARGETS, SGLangOptions, launch
from orbit.engine.sglang.transport import InProcessTransport

__all__ = ["ALL_TARGETS", "SGLangEngine", "SGLangOptions", "slot_name", "start_sglang_engine"]


def start_sglang_engine(model_path: str | Path, **options) -> SGLangEngine:
    """Start `sglang.Engine` on a Hugging Face checkpoint directory and return Orbit's client.

    Options: `SGLangOptions` (max_running, dtype, device, threads, seed, slots, max_lora_rank,
    lora_target_modules, ...). CPU: Orbit's compatibility shims are turned on first. Raises
    EngineError when sglang is missing, EngineDeadError when its processes fail to start.
    """
    opts = SGLangOptions(**options)
    sgl, loop, spec, hf_config, memory_saver, previous_sigquit = launch(model_path, opts)
    transport = InProcessTransport(sgl, memory_saver, previous_sigquit)
    max_context = int(
        sgl.server_args.context_length or opts.context_length or spec.max_position_embeddings
    )
    return SGLangEngine(
        transport,
        loop,
        Path(model_path),
        spec,
        hf_config,
        opts,
        max_context,
        pid=transport.child_pids[0],
        label="SGLang engine",
    )
