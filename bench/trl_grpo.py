"""TRL's GRPOTrainer on an Orbit recipe's workload, as bench/vs_trl.py runs it (one process per
run).

The recipe gives the model, the LoRA adapter, the task (its prompts, in Orbit's order, and its own
grader), the group and batch, the sampling and the optimisation; `matched()` maps each onto
GRPOConfig and says what has no counterpart. Writes OUT/metrics.jsonl (one line per step: wall
clock, reward, tokens), and a checkpoint every `--save-every` steps as OUT/step-N/ (adapter/ in
peft's format, and the recipe: `orbit eval OUT/step-N` reads it as it reads an Orbit run).

    .venv/bin/python bench/trl_grpo.py RECIPE --seed 0 --out runs/vs-trl/trl-0 [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Orbit's algorithm fields → TRL's names (what the recipe sets that TRL has no knob for is listed,
# not silently lost)
LOSS_TYPES = {
    "token-mean": "dapo",
    "seq-mean-token-mean": "grpo",
    "seq-mean-token-sum-norm": "dr_grpo",
}


def matched(recipe) -> tuple[dict, list[str]]:
    """GRPOConfig's arguments for the recipe, and what could not be matched."""
    a, r, t = recipe.algorithm, recipe.rollout, recipe.trainer
    args = {
        "learning_rate": t.lr,
        "lr_scheduler_type": t.schedule,
        "warmup_steps": t.warmup_steps,
        "weight_decay": t.weight_decay,
        "max_grad_norm": t.max_grad_norm,
        "max_steps": t.steps,
        # one generation of the whole batch, trained in `minibatches` optimizer steps
        "num_generations": r.group_size,
        "per_device_train_batch_size": r.group_size * r.prompts_per_step // a.minibatches,
        "max_completion_length": r.max_new_tokens,
        "temperature": r.temperature,
        "top_p": r.top_p,
        "top_k": r.top_k,
        "beta": a.kl_coef,
        "loss_type": LOSS_TYPES[a.aggregation],
        "epsilon": a.clip_eps_low,
        "epsilon_high": a.clip_eps_high,
        "scale_rewards": "group" if a.advantage == "grpo" else "none",
        "mask_truncated_completions": a.overlong == "mask",
        "num_iterations": a.epochs,
        "steps_per_generation": a.minibatches,
    }
    unmatched = [
        "the loop: TRL generates, then trains, one after the other (Orbit's runs double-buffered, "
        "overlapped)",
        f"the ratio: TRL clips against its own old policy (Orbit: ratio {a.ratio} against the "
        "engine's logprobs)",
        "generation: transformers' generate in TRL, Orbit's engine in Orbit (same sampling "
        "settings)",
    ]
    if a.dynamic_sampling:
        unmatched.append(
            "dynamic_sampling: TRL has none (its zero-variance groups stay in the batch)"
        )
    if a.overlong == "penalty":
        unmatched.append("overlong: penalty: TRL has no soft overlong penalty")
    if a.advantage in ("rloo", "batch"):
        unmatched.append(
            f"advantage: {a.advantage} has no GRPOTrainer counterpart (group std used)"
        )
    if a.mask is not None or a.entropy_coef:
        unmatched.append("the mask band and the entropy bonus: not in GRPOTrainer")
    return args, unmatched


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("recipe", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from orbit.config import load_recipe
    from orbit.tasks import make_task

    recipe = load_recipe(args.recipe, {"seed": args.seed, "trainer.steps": args.steps})
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    tokenizer = AutoTokenizer.from_pretrained(recipe.model)
    task = make_task(recipe.task, tokenizer)
    stream = task.prompts(recipe.seed)
    prompts = [next(stream) for _ in range(recipe.trainer.steps * recipe.rollout.prompts_per_step)]
    by_id = {p.id: p for p in prompts}
    system = recipe.task.system
    data = Dataset.from_list(
        [
            {
                "prompt": ([{"role": "system", "content": system}] if system else [])
                + [{"role": "user", "content": p.text}],
                "prompt_id": p.id,
            }
            for p in prompts
        ]
    )

    # Orbit's grader, on the completion's tokens
    def reward(prompts, completions, prompt_id, **_) -> list[float]:
        out = []
        for pid, completion in zip(prompt_id, completions, strict=True):
            text = completion[0]["content"] if isinstance(completion, list) else completion
            ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            out.append(task.score(by_id[pid], ids).reward)
        return out

    config_args, unmatched = matched(recipe)
    (args.out / "matched.json").write_text(
        json.dumps({"grpo_config": config_args, "unmatched": unmatched}, indent=1)
    )
    config = GRPOConfig(
        output_dir=str(args.out / "trl"),
        use_vllm=False,
        use_cpu=True,
        seed=recipe.seed,
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        bf16=False,
        dataloader_num_workers=0,
        **config_args,
    )
    lora = LoraConfig(
        r=recipe.adapter.r,
        lora_alpha=recipe.adapter.alpha,
        lora_dropout=recipe.adapter.dropout,
        target_modules=list(recipe.adapter.target_modules),
        task_type="CAUSAL_LM",
    )
    metrics = (args.out / "metrics.jsonl").open("w")
    t0 = time.time()

    class Record(TrainerCallback):
        def on_log(self, _args, state, _control, logs=None, **kw):
            if logs and "reward" in logs:
                metrics.write(
                    json.dumps(
                        {
                            "step": state.global_step - 1,
                            "t": time.time() - t0,
                            **{k: v for k, v in logs.items() if isinstance(v, int | float)},
                        }
                    )
                    + "\n"
                )
                metrics.flush()

        def on_step_end(self, _args, state, _control, model=None, **kw):
            if state.global_step % args.save_every == 0 or state.global_step == state.max_steps:
                here = args.out / f"step-{state.global_step}"
                model.save_pretrained(here / "adapter")
                shutil.copy(args.recipe, here / "recipe.yaml")
                (here / "time.json").write_text(
                    json.dumps({"t": time.time() - t0, "step": state.global_step})
                )

    trainer = GRPOTrainer(
        model=str(recipe.model),
        reward_funcs=reward,
        args=config,
        train_dataset=data,
        peft_config=lora,
        processing_class=tokenizer,
        callbacks=[Record()],
    )
    trainer.train()
    metrics.close()
    task_close = getattr(task, "close", None)
    if task_close:
        task_close()


if __name__ == "__main__":
    main()
