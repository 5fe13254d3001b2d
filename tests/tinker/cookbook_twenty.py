"""tinker-cookbook's `multiplayer_rl.twenty_questions` as it ships, its answerer the base model it
names (`Qwen/Qwen3.5-9B`) served by `orbit serve` as a second base beside the student's. The one
change: the cookbook loads the answerer's tokenizer from the hub by that name, so this registers a
local one under it first (the cookbook's own `register_tokenizer`); the rest is the recipe's
`build_config` from its command line's config. Run in .venv-tinker, with TINKER_BASE_URL set (the
recipe's clients take no base_url): `python cookbook_twenty.py BASE_URL MODEL LOG_PATH
ANSWERER_TOKENIZER_DIR`."""

from __future__ import annotations

import asyncio
import os
import sys

os.environ.setdefault("TINKER_TELEMETRY", "0")

from tinker_cookbook.recipes.multiplayer_rl.twenty_questions.train import (  # noqa: E402
    CLIConfig,
    build_config,
)
from tinker_cookbook.rl import train  # noqa: E402
from tinker_cookbook.tokenizer_utils import register_tokenizer  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

if __name__ == "__main__":
    url, model, log, tokenizer = sys.argv[1:5]
    os.environ["TINKER_BASE_URL"] = url
    cli = CLIConfig(
        model_name=model,
        renderer_name="role_colon",
        group_size=2,
        batch_size=2,
        max_steps=2,
        eval_every=0,
        save_every=0,
        log_path=log,
        behavior_if_log_dir_exists="delete",
    )
    config = build_config(cli)
    answerer = config.dataset_builder.answerer_base_model  # the recipe's, as it ships
    register_tokenizer(answerer, lambda: AutoTokenizer.from_pretrained(tokenizer))
    print(f"ANSWERER {answerer}", flush=True)
    asyncio.run(train.main(config))
