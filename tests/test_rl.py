"""orbit/rl against the papers' formulas, written out here in plain Python on small hand-made
batches: groups of equal rewards, a single sample, a masked tool token, a completion cut by the
length limit. Each estimator and loss must match to 1e-6."""

from __future__ import annotations

import math

import pytest
import torch

from orbit.config import RecipeError, parse_recipe
from orbit.rl import (
    AlgorithmConfig,
    MaskBand,
    Norm,
    advantages,
    own_norm,
    policy_loss,
    shaped_rewards,
)
from orbit.rl.advantages import batch as batch_advantages
from orbit.rl.advantages import dr_grpo, grpo, rloo
from orbit.rl.filters import call_lengths, carries_signal, left_out, overlong_penalty

GROUPS = [[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0], [0.5, 0.5, 0.5], [2.0]]


def _mean(xs):
    return sum(xs) / len(xs)


def _std(xs):  # the sample std (n - 1), as GRPO's implementations use
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


# ---- advantages -------------------------------------------------------------------------------


@pytest.mark.parametrize("rewards", GROUPS)
def test_grpo_is_the_group_normalised_reward(rewards):
    """DeepSeekMath eq. 3 (outcome supervision): A_i = (r_i - mean(r)) / std(r)."""
    want = (
        [0.0] * len(rewards)
        if len(set(rewards)) < 2
        else [(r - _mean(rewards)) / (_std(rewards) + 1e-6) for r in rewards]
    )
    assert grpo(rewards) == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize("rewards", GROUPS)
def test_dr_grpo_removes_only_the_mean(rewards):
    """Dr. GRPO: A_i = r_i - mean(r), no division by the std."""
    assert dr_grpo(rewards) == pytest.approx([r - _mean(rewards) for r in rewards], abs=1e-6)


@pytest.mark.parametrize("rewards", GROUPS)
def test_rloo_is_the_leave_one_out_baseline(rewards):
    """RLOO (Ahmadian et al. 2024, eq. 6): A_i = r_i - 1/(k-1) sum_{j != i} r_j; one sample: no
    baseline, 0."""
    k = len(rewards)
    want = (
        [0.0]
        if k == 1
        else [
            r - sum(rewards[j] for j in range(k) if j != i) / (k - 1) for i, r in enumerate(rewards)
        ]
    )
    assert rloo(rewards) == pytest.approx(want, abs=1e-6)


def test_batch_is_reinforce_plus_plus_baseline():
    """REINFORCE++ baseline: centred within the group, then divided by the std of those values over
    the batch."""
    centred = [[r - _mean(g) for r in g] for g in GROUPS]
    std = _std([a for g in centred for a in g])
    want = [[a / (std + 1e-6) for a in g] for g in centred]
    got = batch_advantages(GROUPS)
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, abs=1e-6)
    assert advantages(GROUPS, "batch") == got


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "batch"])
def test_a_group_of_equal_rewards_carries_exactly_zero(estimator):
    equal = [[0.1, 0.1, 0.1], [1e9 + 0.3] * 5, [7.0]]
    assert advantages(equal, estimator) == [[0.0] * 3, [0.0] * 5, [0.0]]  # exactly, not nearly
    assert not any(carries_signal(g) for g in equal)
    assert carries_signal([0.0, 1.0])


# ---- rewards and filters -----------------------------------------------------------------------


def test_overlong_penalty_is_dapos():
    """DAPO eq. 13: 0 for |y| <= L_max - L_cache; ((L_max - L_cache) - |y|) / L_cache up to L_max;
    -1 beyond."""
    l_max, cache = 20, 4
    for length in range(0, 26):
        want = (
            0.0
            if length <= l_max - cache
            else ((l_max - cache) - length) / cache
            if length <= l_max
            else -1.0
        )
        assert overlong_penalty(length, l_max, cache) == pytest.approx(want, abs=1e-9)
    cfg = AlgorithmConfig(overlong="penalty", overlong_buffer=4)
    calls = [[10], [18], [20]]
    assert shaped_rewards([1.0, 1.0, 0.0], calls, cfg, 20) == pytest.approx([1.0, 0.5, -1.0])
    assert shaped_rewards([1.0, 1.0], [[10], [20]], AlgorithmConfig(), 20) == [1.0, 1.0]
    # a fifth of the length, as DAPO's 4096 of 20480
    assert AlgorithmConfig(overlong="penalty").buffer(32) == 6


def test_an_episodes_penalty_is_its_longest_calls_each_against_its_own_limit():
    """A multi-turn episode's calls each had max_new_tokens: two answers of 12 tokens are not one
    answer of 24 cut short (which would take a right second attempt's whole reward), and the episode
    takes the penalty of its longest call."""
    mask = [1] * 12 + [0] * 7 + [1] * 12  # an answer, "That is wrong, try again.", an answer
    assert call_lengths(mask) == [12, 12]
    assert call_lengths([0, 1, 1, 0, 0, 1]) == [2, 1] and call_lengths([0, 0]) == []
    cfg = AlgorithmConfig(overlong="penalty", overlong_buffer=4)
    assert shaped_rewards([1.0], [call_lengths(mask)], cfg, 20) == [1.0]
    longest = [1] * 12 + [0] * 7 + [1] * 18 + [0] * 7 + [1] * 17
    assert shaped_rewards([1.0], [call_lengths(longest)], cfg, 20) == pytest.approx([0.5])
    assert shaped_rewards([0.0], [[]], cfg, 20) == [0.0]  # nothing generated: nothing too long


def test_overlong_mask_leaves_out_cut_completions():
    assert left_out(["stop", "length", "stop"], AlgorithmConfig(overlong="mask")) == [
        False,
        True,
        False,
    ]
    assert left_out(["stop", "length"], AlgorithmConfig()) == [False, False]


# ---- the loss, against each paper's objective ---------------------------------------------------

# Three sequences of 3, 2 and 1 trained tokens; the second has a tool token (mask 0) in the middle.
LOGP = [[-1.0, -2.0, -0.5, -0.3], [-0.7, -9.9, -1.2, 0.0], [-2.5, 0.0, 0.0, 0.0]]
OLD = [[-1.2, -1.9, -0.9, 0.0], [-0.6, -3.3, -1.0, 0.0], [-2.0, 0.0, 0.0, 0.0]]
MASK = [[1, 1, 1, 0], [1, 0, 1, 0], [1, 0, 0, 0]]
ADV = [1.5, -0.5, 2.0]
TOKENS = [[t for t in range(4) if MASK[i][t]] for i in range(3)]


def _loss(cfg: AlgorithmConfig, norm: Norm | None = None, **kw):
    logp = torch.tensor(LOGP, requires_grad=True)
    loss, stats = policy_loss(
        logp, torch.tensor(OLD), torch.tensor(ADV), torch.tensor(MASK), cfg, norm, **kw
    )
    loss.backward()
    return loss.item(), logp.grad, stats


def _r(i, t):
    return math.exp(LOGP[i][t] - OLD[i][t])


def _clip(x, lo, hi):
    return min(max(x, lo), hi)


def _check_grad(grad, want):
    for i in range(3):
        for t in range(4):
            assert grad[i, t].item() == pytest.approx(want.get((i, t), 0.0), abs=1e-6), (i, t)


def _aggregate(per_token, aggregation, length=8):
    """The three aggregations of per-token losses l_it, as written in verl's agg_loss and the
    papers."""
    if aggregation == "token-mean":
        return sum(per_token[i][t] for i in range(3) for t in TOKENS[i]) / sum(
            len(ts) for ts in TOKENS
        )
    if aggregation == "seq-mean-token-mean":
        return sum(sum(per_token[i][t] for t in TOKENS[i]) / len(TOKENS[i]) for i in range(3)) / 3
    return sum(sum(per_token[i][t] for t in TOKENS[i]) / length for i in range(3)) / 3


@pytest.mark.parametrize(
    "aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_ppo_clip_higher_in_each_aggregation(aggregation):
    """DAPO eq. 8 (clip-higher): -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) per token,
    aggregated."""
    cfg = AlgorithmConfig(
        ratio="clip",
        clip_eps_low=0.1,
        clip_eps_high=0.3,
        aggregation=aggregation,
        norm_length=8 if aggregation == "seq-mean-token-sum-norm" else None,
    )
    per_token = [
        [
            -min(_r(i, t) * ADV[i], _clip(_r(i, t), 0.9, 1.3) * ADV[i]) if MASK[i][t] else 0.0
            for t in range(4)
        ]
        for i in range(3)
    ]
    loss, grad, stats = _loss(cfg, Norm(tokens=6, sequences=3, length=8))
    assert loss == pytest.approx(_aggregate(per_token, aggregation), abs=1e-6)
    # d/dlogp of -r A is -r A where the clip does not bind, 0 where it does; times the token's
    # weight
    weight = {
        "token-mean": lambda i: 1 / 6,
        "seq-mean-token-mean": lambda i: 1 / (3 * len(TOKENS[i])),
        "seq-mean-token-sum-norm": lambda i: 1 / (3 * 8),
    }[aggregation]
    want = {}
    for i in range(3):
        for t in TOKENS[i]:
            r, a = _r(i, t), ADV[i]
            binds = _clip(r, 0.9, 1.3) * a < r * a
            want[(i, t)] = 0.0 if binds else -r * a * weight(i)
    _check_grad(grad, want)
    assert stats.tokens == 6
    assert stats.clip_frac == pytest.approx(
        sum(
            _clip(_r(i, t), 0.9, 1.3) * ADV[i] < _r(i, t) * ADV[i]
            for i in range(3)
            for t in TOKENS[i]
        )
        / 6
    )


def test_gspo_sequence_ratio():
    """GSPO eq. 5-7: s_i = exp(1/|y_i| sum_t log(pi / pi_old)); J = 1/G sum_i min(s_i A_i, clip(s_i)
    A_i); the gradient of s_i reaches every token of y_i as s_i / |y_i| d log pi_t."""
    eps_lo, eps_hi = 3e-4, 4e-4
    cfg = AlgorithmConfig(preset="gspo")
    assert (cfg.ratio, cfg.ratio_level, cfg.aggregation, cfg.clip_eps_low, cfg.clip_eps_high) == (
        "clip",
        "sequence",
        "seq-mean-token-mean",
        eps_lo,
        eps_hi,
    )
    s = [math.exp(sum(math.log(_r(i, t)) for t in TOKENS[i]) / len(TOKENS[i])) for i in range(3)]
    objective = [min(s[i] * ADV[i], _clip(s[i], 1 - eps_lo, 1 + eps_hi) * ADV[i]) for i in range(3)]
    loss, grad, _ = _loss(cfg)
    assert loss == pytest.approx(-sum(objective) / 3, abs=1e-6)
    want = {}
    for i in range(3):
        binds = _clip(s[i], 1 - eps_lo, 1 + eps_hi) * ADV[i] < s[i] * ADV[i]
        for t in TOKENS[i]:
            want[(i, t)] = 0.0 if binds else -ADV[i] * s[i] / len(TOKENS[i]) / 3
    _check_grad(grad, want)
    # near-on-policy sequences keep their gradient: with a wide range nothing binds
    wide = AlgorithmConfig(
        ratio="clip",
        ratio_level="sequence",
        aggregation="seq-mean-token-mean",
        clip_eps_high=5.0,
        clip_eps_low=0.99,
    )
    _, grad, stats = _loss(wide)
    assert stats.clip_frac == 0.0
    assert all(
        grad[i, t].item() == pytest.approx(-ADV[i] * s[i] / len(TOKENS[i]) / 3, abs=1e-6)
        for i in range(3)
        for t in TOKENS[i]
    )


def test_cispo():
    """MiniMax-M1 eq. 4: J = 1/sum|o_i| sum_i sum_t sg(clip(r_it, 1 - eps_low, 1 + eps_high)) A_i
    log pi_it; every token keeps a gradient, sg(r_hat) A / T."""
    cfg = AlgorithmConfig(preset="cispo")
    assert (cfg.ratio, cfg.clip_eps_low, cfg.clip_eps_high, cfg.aggregation) == (
        "cispo",
        1.0,
        0.28,
        "token-mean",
    )
    w = {(i, t): _clip(_r(i, t), 0.0, 1.28) for i in range(3) for t in TOKENS[i]}
    loss, grad, stats = _loss(cfg)
    assert loss == pytest.approx(-sum(w[i, t] * ADV[i] * LOGP[i][t] for (i, t) in w) / 6, abs=1e-6)
    _check_grad(grad, {(i, t): -w[i, t] * ADV[i] / 6 for (i, t) in w})
    assert all(grad[i, t].item() != 0 for (i, t) in w)
    assert stats.clip_frac == pytest.approx(sum(_r(i, t) > 1.28 for (i, t) in w) / 6)
    # with a lower bound too
    w = {(i, t): _clip(_r(i, t), 0.9, 1.28) for (i, t) in w}
    assert any(_r(i, t) < 0.9 for (i, t) in w)
    loss, grad, _ = _loss(AlgorithmConfig(preset="cispo", clip_eps_low=0.1))
    assert loss == pytest.approx(-sum(w[i, t] * ADV[i] * LOGP[i][t] for (i, t) in w) / 6, abs=1e-6)
    _check_grad(grad, {(i, t): -w[i, t] * ADV[i] / 6 for (i, t) in w})


def test_dr_grpo_preset_uses_a_constant_normaliser():
    """Dr. GRPO: 1/G sum_i 1/L sum_t l_it with L the generation budget, not |o_i|."""
    cfg = AlgorithmConfig(preset="dr_grpo")
    assert (cfg.advantage, cfg.aggregation) == ("dr_grpo", "seq-mean-token-sum-norm")
    per_token = [
        [
            -min(_r(i, t) * ADV[i], _clip(_r(i, t), 0.8, 1.2) * ADV[i]) if MASK[i][t] else 0.0
            for t in range(4)
        ]
        for i in range(3)
    ]
    loss, _, _ = _loss(cfg, Norm(tokens=6, sequences=3, length=32))
    assert loss == pytest.approx(
        _aggregate(per_token, "seq-mean-token-sum-norm", length=32), abs=1e-6
    )


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_a_mask_band_drops_what_leaves_it(level):
    """Rollout correction by masking: tokens (or whole sequences) with p_old / p_engine outside
    [low, high] add nothing; the normaliser stays the batch's."""
    band = MaskBand(low=0.8, high=1.25, level=level)
    cfg = AlgorithmConfig(mask=band)
    if level == "token":
        kept = {(i, t): 0.8 <= _r(i, t) <= 1.25 for i in range(3) for t in TOKENS[i]}
    else:
        seq = [
            math.exp(sum(math.log(_r(i, t)) for t in TOKENS[i]) / len(TOKENS[i])) for i in range(3)
        ]
        kept = {(i, t): 0.8 <= seq[i] <= 1.25 for i in range(3) for t in TOKENS[i]}
    assert 0 < sum(kept.values()) < 6
    w = {k: min(_r(*k), 2.0) for k in kept}  # the default truncated weight
    loss, grad, stats = _loss(cfg)
    assert loss == pytest.approx(
        -sum(w[i, t] * ADV[i] * LOGP[i][t] for (i, t) in kept if kept[i, t]) / 6, abs=1e-6
    )
    _check_grad(grad, {(i, t): -w[i, t] * ADV[i] / 6 if kept[i, t] else 0.0 for (i, t) in kept})
    assert stats.masked == 6 - sum(kept.values())


def test_a_dropped_token_adds_no_kl_and_no_entropy_either():
    """The band drops a token from every term of the loss, as verl's rejection sampling (its
    modified response mask feeds every loss term) and slime's reducers rebuilt from the modified
    mask do: with kl_coef and entropy_coef set, the loss is the kept tokens' policy, k3 KL and
    entropy terms over the step's 6 tokens."""
    cfg = AlgorithmConfig(mask=MaskBand(low=0.8, high=1.25), kl_coef=0.04, entropy_coef=0.01)
    ref = [[-1.1, -2.2, -0.4, 0.0], [-0.9, -5.0, -1.1, 0.0], [-2.2, 0.0, 0.0, 0.0]]
    ent = [[0.5, 1.0, 1.5, 0.0], [2.0, 9.0, 0.7, 0.0], [1.2, 0.0, 0.0, 0.0]]
    kept = [(i, t) for i in range(3) for t in TOKENS[i] if 0.8 <= _r(i, t) <= 1.25]
    assert 0 < len(kept) < 6

    def d(i, t):
        return ref[i][t] - LOGP[i][t]

    def term(i, t):
        k3 = math.exp(d(i, t)) - d(i, t) - 1.0
        return -min(_r(i, t), 2.0) * ADV[i] * LOGP[i][t] + 0.04 * k3 - 0.01 * ent[i][t]

    loss, grad, stats = _loss(cfg, ref_logp=torch.tensor(ref), entropy=torch.tensor(ent))
    assert loss == pytest.approx(sum(term(i, t) for i, t in kept) / 6, abs=1e-6)
    _check_grad(
        grad,
        {
            (i, t): (-min(_r(i, t), 2.0) * ADV[i] + 0.04 * (1.0 - math.exp(d(i, t)))) / 6
            for i, t in kept
        },
    )
    assert stats.masked == 6 - len(kept)


def test_importance_is_the_plain_ratio_times_the_advantage():
    """Plain importance sampling (Tinker's importance_sampling): -r A per token, its gradient
    -r A through the ratio, no cap, over the step's 6 tokens."""
    loss, grad, stats = _loss(AlgorithmConfig(ratio="importance"))
    kept = [(i, t) for i in range(3) for t in TOKENS[i]]
    assert loss == pytest.approx(-sum(_r(i, t) * ADV[i] for i, t in kept) / 6, abs=1e-6)
    _check_grad(grad, {(i, t): -_r(i, t) * ADV[i] / 6 for i, t in kept})
    assert stats.clip_frac == 0.0


def test_orbit_v1_is_the_truncated_weight_over_the_token_mean():
    """Orbit's default before DAPO, unchanged and reachable by name: -min(r, truncate_max) A log pi
    per token, over every trained token. `AlgorithmConfig()` in code and `preset: null` give the
    same."""
    cfg = AlgorithmConfig()
    named = AlgorithmConfig(preset="orbit_v1")
    assert named.model_dump() == {**cfg.model_dump(), "preset": "orbit_v1"}
    assert _recipe(preset=None).algorithm == cfg
    assert (
        cfg.preset,
        cfg.advantage,
        cfg.aggregation,
        cfg.ratio,
        cfg.ratio_level,
        cfg.truncate_max,
        cfg.kl_coef,
        cfg.dynamic_sampling,
        cfg.overlong,
        cfg.minibatches,
        cfg.epochs,
        cfg.mask,
    ) == (None, "grpo", "token-mean", "truncate", "token", 2.0, 0.0, False, "none", 1, 1, None)
    loss, _, _ = _loss(cfg)
    w = {(i, t): min(_r(i, t), 2.0) for i in range(3) for t in TOKENS[i]}
    assert loss == pytest.approx(-sum(w[i, t] * ADV[i] * LOGP[i][t] for (i, t) in w) / 6, abs=1e-6)


def test_a_left_out_sample_adds_nothing_and_counts_nothing():
    """overlong: mask: the cut completion's tokens leave both the sum and the normaliser."""
    mask = torch.tensor(MASK)
    # sample 2 was cut by the length limit: its row leaves the loss mask (train/batch.py)
    mask[2] = 0
    assert own_norm(mask) == Norm(tokens=5, sequences=2)
    logp = torch.tensor(LOGP, requires_grad=True)
    cfg = AlgorithmConfig(aggregation="seq-mean-token-mean")
    loss, _ = policy_loss(logp, torch.tensor(OLD), torch.tensor(ADV), mask, cfg)
    w = {(i, t): min(_r(i, t), 2.0) for i in range(2) for t in TOKENS[i]}
    want = (
        sum(
            sum(-w[i, t] * ADV[i] * LOGP[i][t] for t in TOKENS[i]) / len(TOKENS[i])
            for i in range(2)
        )
        / 2
    )
    assert loss.item() == pytest.approx(want, abs=1e-6)


def test_entropy_bonus_and_kl():
    entropy = torch.tensor(
        [[1.0, 2.0, 0.5, 9.0], [0.2, 9.0, 0.4, 0.0], [3.0, 0.0, 0.0, 0.0]], requires_grad=True
    )
    ref = torch.tensor(OLD)
    cfg = AlgorithmConfig(entropy_coef=0.01, kl_coef=0.1)
    logp = torch.tensor(LOGP, requires_grad=True)
    loss, stats = policy_loss(
        logp,
        torch.tensor(OLD),
        torch.tensor(ADV),
        torch.tensor(MASK),
        cfg,
        ref_logp=ref,
        entropy=entropy,
    )
    loss.backward()
    k3 = {
        (i, t): math.exp(OLD[i][t] - LOGP[i][t]) - (OLD[i][t] - LOGP[i][t]) - 1
        for i in range(3)
        for t in TOKENS[i]
    }
    pg = {(i, t): -min(_r(i, t), 2.0) * ADV[i] * LOGP[i][t] for (i, t) in k3}
    want = sum(pg[k] + 0.1 * k3[k] - 0.01 * entropy[k].item() for k in k3) / 6
    assert loss.item() == pytest.approx(want, abs=1e-6)
    assert (
        entropy.grad[0, 0].item() == pytest.approx(-0.01 / 6) and entropy.grad[0, 3].item() == 0.0
    )
    assert stats.entropy_sum == pytest.approx(sum(entropy[k].item() for k in k3))


@pytest.mark.parametrize(
    "cfg",
    [
        AlgorithmConfig(),
        AlgorithmConfig(aggregation="seq-mean-token-mean"),
        AlgorithmConfig(preset="dr_grpo"),
        AlgorithmConfig(preset="gspo"),
        AlgorithmConfig(preset="cispo"),
        AlgorithmConfig(ratio="decoupled"),
        AlgorithmConfig(mask=MaskBand(low=0.8, high=1.25, level="sequence")),
    ],
    ids=lambda c: f"{c.preset}-{c.aggregation}",
)
def test_micro_batches_add_up_to_the_whole_batch(cfg):
    """Any cut of the batch into micro-batches, each divided by the whole batch's Norm, sums to the
    whole."""
    norm = Norm(tokens=6, sequences=3, length=8)
    whole, grad, _ = _loss(cfg, norm)
    logp = torch.tensor(LOGP, requires_grad=True)
    total = sum(
        policy_loss(
            logp[rows],
            torch.tensor(OLD)[rows],
            torch.tensor(ADV)[rows],
            torch.tensor(MASK)[rows],
            cfg,
            norm,
        )[0]
        for rows in (slice(0, 1), slice(1, 3))
    )
    total.backward()
    assert total.item() == pytest.approx(whole, abs=1e-6)
    assert torch.allclose(logp.grad, grad, atol=1e-7)


# ---- the recipe section --------------------------------------------------------------------------


def _recipe(**algorithm):
    return parse_recipe({"model": "m", "algorithm": algorithm})


def test_a_recipe_that_names_no_preset_gets_dapo():
    """The default a recipe gets without asking is the measured best (docs/algorithms.md):
    DAPO, with or without an `algorithm:` section, the fields it sets winning."""
    bare = parse_recipe({"model": "m"}).algorithm
    assert (
        bare
        == _recipe(preset="dapo").algorithm
        == parse_recipe({"model": "m", "algorithm": None}).algorithm
    )
    assert (bare.preset, bare.ratio, bare.clip_eps_high, bare.dynamic_sampling) == (
        "dapo",
        "clip",
        0.28,
        True,
    )
    assert _recipe(kl_coef=0.01).algorithm.model_dump() == {**bare.model_dump(), "kl_coef": 0.01}
    # the run directory's recipe.yaml names the preset: a later default cannot change a resumed run
    assert parse_recipe({"model": "m"}).model_dump(mode="json")["algorithm"]["preset"] == "dapo"


def test_presets_fill_what_the_recipe_leaves_unset():
    dapo = _recipe(preset="dapo").algorithm
    assert (
        dapo.clip_eps_low,
        dapo.clip_eps_high,
        dapo.dynamic_sampling,
        dapo.overlong,
        dapo.aggregation,
    ) == (0.2, 0.28, True, "penalty", "token-mean")
    mine = _recipe(preset="dapo", clip_eps_high=0.3, dynamic_sampling=False).algorithm
    assert (mine.clip_eps_high, mine.dynamic_sampling, mine.overlong) == (0.3, False, "penalty")
    rloo_ = _recipe(preset="rloo").algorithm
    assert (rloo_.advantage, rloo_.ratio) == ("rloo", "truncate")
    assert _recipe(preset="grpo").algorithm.kl_coef == 0.04


@pytest.mark.parametrize(
    "algorithm, words",
    [
        ({"ratio": "cispo", "ratio_level": "sequence"}, "algorithm.ratio_level: sequence"),
        (
            {"ratio": "truncate", "clip_eps_high": 0.3},
            "algorithm.clip_eps_high: has no effect with ratio 'truncate'",
        ),
        ({"preset": "rloo", "clip_eps_low": 0.1}, "algorithm.clip_eps_low: has no effect"),
        (
            {"ratio": "clip", "truncate_max": 3},
            "algorithm.truncate_max: has no effect with ratio 'clip'",
        ),
        ({"norm_length": 16}, "algorithm.norm_length"),
        (
            {"overlong": "none", "overlong_buffer": 4},
            "algorithm.overlong_buffer: the buffer of overlong: penalty",
        ),
        ({"overlong": "penalty", "overlong_buffer": 40}, "algorithm.overlong_buffer: 40 tokens"),
        ({"minibatches": 8}, "algorithm.minibatches: 8 mini-batches of 4 groups"),
        ({"mask": {"low": 1.2}}, "algorithm.mask.low"),
        ({"preset": "ppo"}, "algorithm.preset"),
        ({"advantage": "gae"}, "algorithm.advantage"),
    ],
)
def test_combinations_that_mean_nothing_are_refused_at_load(algorithm, words):
    with pytest.raises(RecipeError) as err:
        _recipe(**algorithm)
    assert words in str(err.value)


def test_a_one_token_rollout_under_the_default_says_how_to_drop_its_overlong_penalty():
    """DAPO's overlong penalty (the default's) has no room under max_new_tokens 1: the error names
    the field and the ways out, and overlong: none loads."""
    recipe = {"model": "m", "rollout": {"max_new_tokens": 1}}
    with pytest.raises(RecipeError) as err:
        parse_recipe(recipe)
    assert "algorithm.overlong_buffer: 1 tokens leaves no length unpunished" in str(err.value)
    assert "algorithm.overlong: none" in str(err.value) and "the dapo preset" in str(err.value)
    assert parse_recipe({**recipe, "algorithm": {"overlong": "none"}}).algorithm.preset == "dapo"


def test_the_old_loss_section_says_where_it_went():
    with pytest.raises(
        RecipeError, match="trainer.loss: the loss moved to the recipe's own `algorithm:` section"
    ):
        parse_recipe({"model": "m", "trainer": {"loss": {"ratio": "clip"}}})
