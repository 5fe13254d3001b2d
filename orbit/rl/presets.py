"""The algorithms users ask for by name, as the settings of `algorithm:` their papers give.

A preset fills the fields a recipe leaves unset; a field set in the recipe wins. A recipe that names
none gets DEFAULT_PRESET: of the presets measured on the three laptop recipes it held out best and
fell least (docs/algorithms.md). `orbit_v1` is Orbit's default before that: GRPO advantages, the
token mean, a truncated importance weight against the engine's policy; it is also what
`AlgorithmConfig()` and `preset: null` give, every field at its own default.
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # Orbit's default until DAPO measured better (issue 40): the fields' own defaults, named so that
    # a recipe written for it keeps it
    "orbit_v1": {
        "advantage": "grpo",
        "aggregation": "token-mean",
        "ratio": "truncate",
        "truncate_max": 2.0,
        "dynamic_sampling": False,
        "overlong": "none",
        "kl_coef": 0.0,
    },
    # DeepSeekMath (Shao et al. 2024): group-normalised advantages, each sequence's token mean, PPO
    # clip, KL to the reference (beta 0.04)
    "grpo": {
        "advantage": "grpo",
        "aggregation": "seq-mean-token-mean",
        "ratio": "clip",
        "clip_eps_low": 0.2,
        "clip_eps_high": 0.2,
        "kl_coef": 0.04,
    },
    # Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): no std division, no length
    # division (a constant normaliser), no KL
    "dr_grpo": {
        "advantage": "dr_grpo",
        "aggregation": "seq-mean-token-sum-norm",
        "ratio": "clip",
        "clip_eps_low": 0.2,
        "clip_eps_high": 0.2,
        "kl_coef": 0.0,
    },
    # DAPO (Yu et al. 2025): clip-higher 0.2 / 0.28, dynamic sampling, the token mean, the soft
    # overlong penalty (its buffer a fifth of the length: 4096 of 20480 there), no KL
    "dapo": {
        "advantage": "grpo",
        "aggregation": "token-mean",
        "ratio": "clip",
        "clip_eps_low": 0.2,
        "clip_eps_high": 0.28,
        "dynamic_sampling": True,
        "overlong": "penalty",
        "kl_coef": 0.0,
    },
    # GSPO (Zheng et al. 2025): the sequence's importance ratio (the geometric mean of its token
    # ratios) in the clip, 3e-4 / 4e-4; each rollout batch in 4 mini-batches; no KL
    "gspo": {
        "advantage": "grpo",
        "aggregation": "seq-mean-token-mean",
        "ratio": "clip",
        "ratio_level": "sequence",
        "clip_eps_low": 3e-4,
        "clip_eps_high": 4e-4,
        "minibatches": 4,
        "kl_coef": 0.0,
    },
    # CISPO (MiniMax-M1, 2025): the clipped importance weight, its gradient stopped, times the
    # log-probability; no lower bound (the paper tunes only the upper: 0.28 as Trinity-RFT), the
    # token mean
    "cispo": {
        "advantage": "grpo",
        "aggregation": "token-mean",
        "ratio": "cispo",
        "clip_eps_low": 1.0,
        "clip_eps_high": 0.28,
        "kl_coef": 0.0,
    },
    # RLOO (Ahmadian et al. 2024, "Back to Basics"): the leave-one-out baseline and REINFORCE on
    # whole sequences (their log-probability summed; a constant normaliser keeps the scale), an IS
    # weight for Orbit's off-policy samples, no clip
    "rloo": {
        "advantage": "rloo",
        "aggregation": "seq-mean-token-sum-norm",
        "ratio": "truncate",
        "kl_coef": 0.0,
    },
}

PRESET_NAMES = tuple(PRESETS)

# What a recipe gets when its `algorithm:` section names no preset (or it has none).
DEFAULT_PRESET = "dapo"
