"""tinker-cookbook's supervised loop (`tinker_cookbook.supervised.train.main`) as chat_sl builds
it for a conversations file, with 16 conversations held out: its NLL evaluator (SamplerNLLEvaluator,
the sampling client's compute_logprobs of each held-out datum) runs every step. chat_sl's command
line holds nothing out of a local file, hence this script. Run in .venv-tinker:
`python cookbook_sl_eval.py BASE_URL MODEL LOG_PATH`."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

os.environ.setdefault("TINKER_TELEMETRY", "0")

import chz  # noqa: E402
import tinker_cookbook  # noqa: E402
from tinker_cookbook.recipes.chat_sl.train import get_dataset_builder  # noqa: E402
from tinker_cookbook.renderers import TrainOnWhat  # noqa: E402
from tinker_cookbook.supervised.train import Config, main  # noqa: E402

CONVERSATIONS = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"


def config(base_url: str, model: str, log_path: str) -> Config:
    data = get_dataset_builder(
        str(CONVERSATIONS), model, "role_colon", 256, 32, TrainOnWhat.ALL_ASSISTANT_MESSAGES
    )
    return Config(
        log_path=log_path,
        model_name=model,
        recipe_name="recipe_chat_sl",
        renderer_name="role_colon",
        dataset_builder=chz.replace(data, test_size=16),
        learning_rate=1e-4,
        base_url=base_url,
        lora_rank=4,
        save_every=0,
        eval_every=1,
        max_steps=2,
    )


if __name__ == "__main__":
    url, model_path, log = sys.argv[1:4]
    asyncio.run(main(config(url, model_path, log)))
