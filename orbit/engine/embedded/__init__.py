"""Orbit's embedded engine (docs/design.md §4): its own decoder, KV cache, continuous batching,
prefix cache and a ring of adapter slots, in a process of its own.

    model.py      decoder for Llama/Qwen2/Qwen3 checkpoints (plain tensors, fused projections)
    slots.py      LoRA/OFT slots from peft state dicts; per-row application in mixed batches
    scheduler.py  one request's state, continuous batching and KV row assignment
    sampler.py    vectorised per-row sampling and logprobs
    kv_cache.py   KV row pool and prefix cache
    engine.py     EngineCore: the step loop and the protocol's control calls (in-process)
    process.py    the engine's process: its command loop, and EmbeddedClient (the Engine protocol,
                  trainer side) with start_embedded_engine
"""

from orbit.engine.embedded.engine import EngineCore, EngineOptions
from orbit.engine.embedded.process import EmbeddedClient, start_embedded_engine

__all__ = ["EmbeddedClient", "EngineCore", "EngineOptions", "start_embedded_engine"]
