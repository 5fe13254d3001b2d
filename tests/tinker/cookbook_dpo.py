"""tinker-cookbook's DPO (`tinker_cookbook.preference.train_dpo.main`) on preference pairs in a
local JSONL file (the cookbook's `ComparisonBuilderFromJsonl`): its reference logprobs are a
sampling client's compute_logprobs, its loss a client-side custom loss (forward_backward_custom).
Run in .venv-tinker: `python cookbook_dpo.py BASE_URL MODEL LOG_PATH`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TINKER_TELEMETRY", "0")

from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons  # noqa: E402
from tinker_cookbook.preference.preference_datasets import ComparisonBuilderFromJsonl  # noqa: E402
from tinker_cookbook.preference.train_dpo import Config, main  # noqa: E402
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig  # noqa: E402


def pairs(path: Path, n: int = 8) -> None:
    """`n` labelled comparisons: the short answer preferred to the long one."""
    with path.open("w") as f:
        for i in range(n):
            prompt = [{"role": "user", "content": f"What is {i} plus {i}?"}]
            short = [{"role": "assistant", "content": str(2 * i)}]
            long = [{"role": "assistant", "content": f"Let me think. It is {2 * i}, I believe."}]
            comparison = {
                "prompt_conversation": prompt,
                "completion_A": short,
                "completion_B": long,
            }
            f.write(json.dumps({"comparison": comparison, "label": "A"}) + "\n")


def config(base_url: str, model: str, log_path: str, data: Path) -> Config:
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=model, renderer_name="role_colon", max_length=128, batch_size=4
    )
    dataset = DPODatasetBuilderFromComparisons(
        comparison_builder=ComparisonBuilderFromJsonl(train_path=str(data)), common_config=common
    )
    return Config(
        log_path=log_path,
        model_name=model,
        recipe_name="recipe_dpo",
        dataset_builder=dataset,
        renderer_name="role_colon",
        learning_rate=1e-4,
        lora_rank=4,
        base_url=base_url,
        save_every=0,
        eval_every=0,
        max_steps=2,
    )


if __name__ == "__main__":
    url, model_path, log = sys.argv[1:4]
    data = Path(log).parent / "pairs.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    pairs(data)
    main(config(url, model_path, log, data))
