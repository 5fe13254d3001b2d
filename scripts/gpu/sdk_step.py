"""The GPU check's serve step, as a Tinker user drives it (the `tinker` SDK 0.38): `python
sdk_step.py BASE_URL MODEL` against an `orbit serve` (scripts/gpu/check.py starts it). Prints one
line, RESULT {json}, of what it saw and how long each call took."""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("TINKER_TELEMETRY", "0")

import tinker  # noqa: E402
from tinker import types  # noqa: E402

TOKENS = [1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45]


def timed(seen: dict, name: str, call):
    t0 = time.monotonic()
    out = call()
    seen[f"{name}_s"] = round(time.monotonic() - t0, 3)
    return out


def main(url: str, model: str) -> dict:
    service = tinker.ServiceClient(base_url=url)
    seen: dict = {}
    client = timed(
        seen,
        "create_training_client",
        lambda: service.create_lora_training_client(base_model=model, rank=8).result(),
    )
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)},
    )
    for i in range(2):
        out = timed(
            seen,
            f"forward_backward_{i}",
            lambda: client.forward_backward([datum], "cross_entropy").result(),
        )
        seen[f"loss_{i}"] = float(out.metrics.get("loss:sum", float("nan")))
        timed(
            seen,
            f"optim_step_{i}",
            lambda: client.optim_step(types.AdamParams(learning_rate=1e-3)).result(),
        )
    prompt = types.ModelInput.from_ints(TOKENS[:4])
    params = types.SamplingParams(max_tokens=16, temperature=1.0)
    snapshot = timed(seen, "snapshot", lambda: client.save_weights_and_get_sampling_client())
    got = timed(seen, "snapshot_sample", lambda: snapshot.sample(prompt, 4, params).result())
    seen["snapshot_tokens"] = [len(s.tokens) for s in got.sequences]
    try:
        inflight = timed(
            seen,
            "inflight",
            lambda: client.save_weights_and_get_sampling_client(kind="inflight"),
        )
        got = timed(seen, "inflight_sample", lambda: inflight.sample(prompt, 4, params).result())
        seen["inflight_tokens"] = [len(s.tokens) for s in got.sequences]
        client.forward_backward([datum], "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        # a later inflight save updates the target existing inflight samplers sample from
        timed(
            seen,
            "inflight_save",
            lambda: client.save_weights_and_get_sampling_client(kind="inflight"),
        )
        got = timed(
            seen, "inflight_sample_after", lambda: inflight.sample(prompt, 4, params).result()
        )
        seen["inflight_tokens_after"] = [len(s.tokens) for s in got.sequences]
    except Exception as err:  # noqa: BLE001 - what the service answers is the finding
        seen["inflight_error"] = f"{type(err).__name__}: {err}"[:500]
    return seen


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1], sys.argv[2])), flush=True)
