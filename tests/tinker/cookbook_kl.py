"""tinker-cookbook's RL loop (`tinker_cookbook.rl.train.main`) on math_rl's arithmetic sums, with a
KL penalty against the base model (`KLReferenceConfig`): the cookbook's own Config, as math_rl
builds it, plus the two fields its command line does not set. Run in .venv-tinker:
`python cookbook_kl.py BASE_URL MODEL LOG_PATH`."""

from __future__ import annotations

import asyncio
import os
import sys

os.environ.setdefault("TINKER_TELEMETRY", "0")

import chz  # noqa: E402
from tinker_cookbook.recipes.math_rl.train import get_dataset_builder  # noqa: E402
from tinker_cookbook.rl.train import Config, KLReferenceConfig, main  # noqa: E402


def sums(model: str):
    """math_rl's arithmetic sums: 2 groups of 4 a batch, the role_colon renderer."""
    return get_dataset_builder(
        env="arithmetic",
        batch_size=2,
        model_name=model,
        renderer_name="role_colon",
        group_size=4,
        seed=0,
    )


def config(base_url: str, model: str, log_path: str) -> Config:
    made = Config(
        learning_rate=3e-4,
        dataset_builder=sums(model),
        model_name=model,
        recipe_name="recipe_math_rl",
        renderer_name="role_colon",
        lora_rank=4,
        max_tokens=6,
        log_path=log_path,
        base_url=base_url,
        eval_every=0,
        save_every=0,
        loss_fn="importance_sampling",
        max_steps=2,
    )
    return chz.replace(
        made, kl_penalty_coef=0.05, kl_reference_config=KLReferenceConfig(base_model=model)
    )


if __name__ == "__main__":
    url, model_path, log = sys.argv[1:4]
    asyncio.run(main(config(url, model_path, log)))
