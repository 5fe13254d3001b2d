"""tinker-cookbook's on-policy distillation (`tinker_cookbook.distillation.train_on_policy.main`) on
math_rl's arithmetic sums, with a teacher that is a checkpoint this service trained: a client of
its own takes a few cross-entropy steps and saves its sampler's weights, then the student learns
from the teacher's logprobs of its own samples (the teacher's compute_logprobs). Run in
.venv-tinker: `python cookbook_distill.py BASE_URL MODEL LOG_PATH [TEACHER_MODEL]`: the teacher
on the student's base model, or on TEACHER_MODEL (another base the service serves)."""

from __future__ import annotations

import asyncio
import os
import sys

os.environ.setdefault("TINKER_TELEMETRY", "0")

import tinker  # noqa: E402
from cookbook_kl import sums  # noqa: E402  (this directory: the script's own, on sys.path)
from tinker import types  # noqa: E402
from tinker_cookbook.distillation.datasets import (  # noqa: E402
    DistillationDatasetConfig,
    TeacherConfig,
)
from tinker_cookbook.distillation.train_on_policy import Config, main  # noqa: E402


def teacher(base_url: str, model: str) -> str:
    """A checkpoint of a client this service trained: its sampler's weights' path."""
    service = tinker.ServiceClient(base_url=base_url)
    client = service.create_lora_training_client(base_model=model, rank=4, seed=3).result()
    tokens = [1, 5, 9, 13, 17, 21, 25, 29]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    for _ in range(2):
        client.forward_backward([datum], "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return client.save_weights_for_sampler("teacher").result().path


def config(
    base_url: str, model: str, log_path: str, teacher_path: str, teacher_model: str
) -> Config:
    return Config(
        learning_rate=3e-4,
        dataset_configs=[
            DistillationDatasetConfig(
                dataset_builder=sums(model),
                teacher_config=TeacherConfig(
                    base_model=teacher_model, load_checkpoint_path=teacher_path
                ),
                groups_per_batch=2,
            )
        ],
        model_name=model,
        recipe_name="recipe_distillation",
        renderer_name="role_colon",
        max_tokens=6,
        lora_rank=4,
        log_path=log_path,
        base_url=base_url,
        eval_every=0,
        save_every=0,
        max_steps=2,
    )


if __name__ == "__main__":
    url, model_path, log = sys.argv[1:4]
    teacher_model = sys.argv[4] if len(sys.argv) > 4 else model_path
    path = teacher(url, teacher_model)
    print(f"TEACHER {path}", flush=True)
    asyncio.run(main(config(url, model_path, log, path, teacher_model)))
