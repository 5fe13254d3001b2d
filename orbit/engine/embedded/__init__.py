"""Orbit's embedded engine (docs/design.md §4): its own decoder, KV cache, continuous batching, prefix
cache and two adapter slots, in its own process.

    model.py      decoder for Llama/Qwen2 checkpoints (plain tensors, fused projections)
    slots.py      LoRA/OFT slots from peft state dicts; per-row application in mixed batches
    sequence.py   one request's state
    sampler.py    vectorised per-row sampling and logprobs
    kv_cache.py   KV row pool and prefix cache
    scheduler.py  continuous batching and KV row assignment
    engine.py     EngineCore: the step loop and the protocol's control calls (in-process)
    process.py    the engine process's command loop
    client.py     EmbeddedClient (the Engine protocol, trainer side) and start_embedded_engine
"""

from orbit.engine.embedded.client import EmbeddedClient, start_embedded_engine
from orbit.engine.embedded.engine import EngineCore, EngineOptions

__all__ = ["EmbeddedClient", "EngineCore", "EngineOptions", "start_embedded_engine"]
