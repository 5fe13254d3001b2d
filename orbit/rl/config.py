"""The recipe's `algorithm:` section: the estimator, the loss and its aggregation, the filters.

A `preset` fills the fields the recipe leaves unset (presets.py). A field that has no effect with
the chosen loss (a clip range with `ratio: truncate`) is refused when the recipe sets it, and so is
a combination that means nothing (a sequence-level ratio with CISPO's token weights). A recipe whose
section names no preset gets DEFAULT_PRESET (`recipe_section`); the class itself, built in code
(`AlgorithmConfig(ratio=...)`, as `orbit serve`'s losses are), takes only what it is given, every
other field at its own default: `orbit_v1`'s settings.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from orbit.rl.presets import DEFAULT_PRESET, PRESET_NAMES, PRESETS

ADVANTAGES = ("grpo", "dr_grpo", "rloo", "batch")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
RATIOS = ("truncate", "clip", "decoupled", "cispo", "importance")

# Fields that mean something only with some ratios: set with another, they are refused.
_ONLY_WITH = {
    "clip_eps_low": ("clip", "decoupled", "cispo"),
    "clip_eps_high": ("clip", "decoupled", "cispo"),
    "truncate_max": ("truncate", "decoupled"),
}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class MaskBand(_Section):
    """Rollout correction by masking: a token (or a whole sequence) whose behaviour ratio, the
    trainer's policy before the step over the engine's, falls outside [low, high] is dropped from
    the loss."""

    low: float = Field(0.5, ge=0.0, lt=1.0, description="drop below this ratio")
    high: float = Field(2.0, gt=1.0, description="drop above this ratio")
    level: Literal["token", "sequence"] = Field(
        "token",
        description="token: each token's ratio; sequence: the "
        "geometric mean of a sequence's token ratios, the whole sequence",
    )


class AlgorithmConfig(_Section):
    preset: Literal[PRESET_NAMES] | None = Field(  # type: ignore[valid-type]
        None,
        description="orbit_v1 | grpo | dr_grpo | dapo | gspo | cispo | rloo: the paper's settings "
        "for the fields left unset (docs/algorithms.md); a recipe that names none gets "
        f"{DEFAULT_PRESET}; orbit_v1 (or null): Orbit's default before it (GRPO advantages, token "
        "mean, truncated IS)",
    )
    advantage: Literal[ADVANTAGES] = Field(  # type: ignore[valid-type]
        "grpo",
        description="grpo: (r - group mean) / group std; dr_grpo: r - group mean; rloo: r - mean "
        "of the "
        "group's others; batch: (r - group mean) / the batch's std (REINFORCE++ baseline)",
    )
    aggregation: Literal[AGGREGATIONS] = Field(  # type: ignore[valid-type]
        "token-mean",
        description="token-mean: over every trained token of the batch (DAPO); "
        "seq-mean-token-mean: "
        "each sequence's token mean, then the mean over sequences (GRPO); seq-mean-token-sum-norm: "
        "each "
        "sequence's token sum over norm_length, then the mean over sequences (Dr. GRPO)",
    )
    norm_length: int | None = Field(
        None,
        ge=1,
        description="seq-mean-token-sum-norm's constant normaliser "
        "(default rollout.max_new_tokens)",
    )
    ratio: Literal[RATIOS] = Field(  # type: ignore[valid-type]
        "truncate",
        description="truncate: policy gradient times min(p / p_engine, truncate_max); clip: PPO's "
        "clip "
        "against the engine's policy; decoupled: PPO's clip against the trainer's policy before "
        "the step, times "
        "min(p_prox / p_engine, truncate_max) (AReaL); cispo: the clipped ratio, its gradient "
        "stopped, times log p; importance: -(p / p_engine) A, the ratio itself, untruncated "
        "(Tinker's importance_sampling)",
    )
    ratio_level: Literal["token", "sequence"] = Field(
        "token",
        description="sequence: one ratio per sequence, the geometric mean of its token ratios "
        "(GSPO)",
    )
    clip_eps_low: float = Field(
        0.2,
        gt=0.0,
        le=1.0,
        description="the ratio's lower clip: 1 - clip_eps_low (1: no lower bound)",
    )
    clip_eps_high: float = Field(
        0.2,
        gt=0.0,
        description="the ratio's upper clip: 1 + clip_eps_high (clip-higher: above clip_eps_low)",
    )
    truncate_max: float = Field(
        2.0, ge=1.0, description="cap of the importance weight (truncate, decoupled)"
    )
    mask: MaskBand | None = Field(
        None, description="drop tokens or sequences whose behaviour ratio leaves the band"
    )
    kl_coef: float = Field(0.0, ge=0.0, description="k3 KL to the base model; 0 = off")
    entropy_coef: float = Field(
        0.0, ge=0.0, description="entropy bonus: the loss minus this times the entropy"
    )
    dynamic_sampling: bool = Field(
        False,
        description="drop groups whose rewards are all equal before they reach "
        "the trainer and start others in their place (DAPO), so every batch is full",
    )
    filter_limit: int = Field(
        10,
        ge=1,
        le=1000,
        description="with dynamic_sampling: when this many batches' worth of groups were "
        "dropped while the trainer waited for one batch, stop the run if under a batch of "
        "groups has carried signal yet, else dynamic sampling stands aside for the rest of the "
        "run (with a warning)",
    )
    screen: int | None = Field(
        None,
        ge=2,
        description="with dynamic_sampling: generate this many samples of a prompt first (a "
        "probe, never trained), and a group of it only unless all of them reached the best "
        "reward the run has seen (a prompt the policy already solves, which dynamic sampling "
        "would most likely drop whole). Weights a prompt of pass rate p by "
        "(1 - p^k)(1 - p^n - (1-p)^n) instead of 1 - p^n - (1-p)^n (docs/algorithms.md)",
    )
    screen_from: float = Field(
        0.5,
        ge=0,
        le=1,
        description="with screen: probes run only while at least this share of the recent "
        "prompts were screened out (or, started as a group, would have been); until then a "
        "probe costs more than it saves. 0: from the start",
    )
    overlong: Literal["none", "mask", "penalty"] = Field(
        "none",
        description="completions cut by max_new_tokens: none (as any); mask (left out of the "
        "loss); penalty "
        "(DAPO's soft overlong penalty, added to the reward)",
    )
    overlong_buffer: int | None = Field(
        None,
        ge=1,
        description="overlong: penalty's buffer: the penalty grows from "
        "0 to -1 over the last this many tokens (default max_new_tokens // 5)",
    )
    minibatches: int = Field(
        1,
        ge=1,
        le=64,
        description="optimizer steps per pass over a batch, each on a share of its groups",
    )
    epochs: int = Field(1, ge=1, le=64, description="passes over each batch")

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        preset = PRESETS.get(str(data.get("preset")), {})
        ratio = data.get("ratio", preset.get("ratio", "truncate"))
        for name, ratios in _ONLY_WITH.items():
            if name in data and ratio not in ratios:
                raise ValueError(
                    f"algorithm.{name}: has no effect with ratio {ratio!r} (it applies to "
                    f"{', '.join(ratios)})"
                )
        if data.get("preset") in PRESETS:
            preset = PRESETS[data["preset"]]
            data = {
                **{
                    k: v for k, v in preset.items() if k not in _ONLY_WITH or ratio in _ONLY_WITH[k]
                },
                **data,
            }
        return data

    @model_validator(mode="after")
    def _consistent(self) -> AlgorithmConfig:
        if self.ratio_level == "sequence" and self.ratio in ("cispo", "decoupled"):
            raise ValueError(
                "algorithm.ratio_level: sequence (GSPO) puts one ratio per sequence in a clip "
                f"(ratio: clip) or a truncated weight (ratio: truncate); {self.ratio} weighs each "
                "token on its own"
            )
        if self.norm_length is not None and self.aggregation != "seq-mean-token-sum-norm":
            raise ValueError(
                "algorithm.norm_length: the constant of seq-mean-token-sum-norm; aggregation is "
                f"{self.aggregation!r}"
            )
        if self.screen is not None and not self.dynamic_sampling:
            raise ValueError(
                "algorithm.screen: staged sampling drops early the groups dynamic sampling "
                "would drop; dynamic_sampling is off"
            )
        if self.overlong_buffer is not None and self.overlong != "penalty":
            raise ValueError(
                "algorithm.overlong_buffer: the buffer of overlong: penalty; overlong is "
                f"{self.overlong!r}"
            )
        return self

    @model_serializer(mode="wrap")
    def _applicable(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """What a recipe.yaml shows and loads again: the fields that apply to this ratio, unset ones
        left out."""
        return {
            k: v
            for k, v in handler(self).items()
            if (k not in _ONLY_WITH or self.ratio in _ONLY_WITH[k])
            and (v is not None or k == "preset")
        }

    def summary(self, max_new_tokens: int) -> str:
        """The resolved settings in one line (`orbit recipe check`), the defaults that depend on the
        rollout filled in."""
        fields = {k: v for k, v in self.model_dump(mode="json").items() if k != "preset"}
        if self.aggregation == "seq-mean-token-sum-norm":
            fields["norm_length"] = self.norm(max_new_tokens)
        if self.overlong == "penalty":
            fields["overlong_buffer"] = self.buffer(max_new_tokens)
        shown = ", ".join(f"{k} {v}" for k, v in fields.items())
        return f"algorithm: {self.preset or 'orbit_v1'} ({shown})"

    def norm(self, max_new_tokens: int) -> int:
        """seq-mean-token-sum-norm's constant."""
        return self.norm_length or max_new_tokens

    def buffer(self, max_new_tokens: int) -> int:
        """The overlong penalty's buffer, in tokens."""
        return self.overlong_buffer or max(max_new_tokens // 5, 1)

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps per batch."""
        return self.minibatches * self.epochs


def recipe_section(data: Any) -> Any:
    """A recipe's `algorithm:` section as written (a mapping, or nothing): one that names no preset
    gets DEFAULT_PRESET, so a recipe without the section trains with the measured best."""
    if data is None:
        return {"preset": DEFAULT_PRESET}
    if isinstance(data, dict) and "preset" not in data:
        return {"preset": DEFAULT_PRESET, **data}
    return data
