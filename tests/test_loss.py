"""Orbit's default advantages and its three original ratios, against hand-computed values (the
estimators, aggregations and ratios the presets add: test_rl.py)."""

from __future__ import annotations

import math

import pytest
import torch

from orbit.rl import AlgorithmConfig as LossConfig
from orbit.rl import Norm, policy_loss
from orbit.rl.advantages import grpo as group_advantages

LOGP = [[-1.0, -2.0], [-1.0, -2.0]]
BEHAVIOUR = [[-1.5, -1.0], [-1.5, -1.0]]  # ratios e^0.5 = 1.6487 and e^-1 = 0.3679
R_HI, R_LO = math.exp(0.5), math.exp(-1.0)


def _inputs(adv: list[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    logp = torch.tensor(LOGP, requires_grad=True)
    return logp, torch.tensor(BEHAVIOUR), torch.tensor(adv), torch.ones(2, 2)


def test_group_advantages_hand_values():
    # mean 0.5, sample std sqrt(1/3)
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    expected = 0.5 / math.sqrt(1 / 3)
    assert adv == pytest.approx([expected, -expected, -expected, expected], rel=1e-5)
    adv = group_advantages([3.0, 1.0, 2.0])
    assert adv == pytest.approx([1.0, -1.0, 0.0], rel=1e-5)  # std 1
    assert sum(adv) == pytest.approx(0.0, abs=1e-9)


def test_group_advantages_all_equal_is_exactly_zero():
    assert group_advantages([0.1, 0.1, 0.1]) == [0.0, 0.0, 0.0]
    assert group_advantages([1.0, 1.0]) == [0.0, 0.0]
    assert group_advantages([5.0]) == [0.0]


def test_truncate_loss_and_gradient():
    logp, behaviour, adv, mask = _inputs([2.0, -1.0])
    cfg = LossConfig(ratio="truncate", truncate_max=1.5)
    loss, stats = policy_loss(logp, behaviour, adv, mask, cfg)
    w = [1.5, R_LO]  # min(ratio, 1.5), no gradient through it
    expected = -(w[0] * 2 * -1 + w[1] * 2 * -2 + w[0] * -1 * -1 + w[1] * -1 * -2) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    loss.backward()
    grad = [[-w[0] * 2 / 4, -w[1] * 2 / 4], [w[0] / 4, w[1] / 4]]
    assert logp.grad.tolist() == [pytest.approx(g, rel=1e-5) for g in grad]
    assert stats.ratio_mean == pytest.approx((R_HI + R_LO) / 2, rel=1e-5)
    assert stats.ratio_max == pytest.approx(R_HI, rel=1e-5)
    assert stats.clip_frac == pytest.approx(0.5)
    assert stats.tokens == 4
    assert math.isnan(stats.kl)


def test_clip_loss_and_gradient():
    logp, behaviour, adv, mask = _inputs([2.0, -1.0])
    cfg = LossConfig(ratio="clip", clip_eps_low=0.2, clip_eps_high=0.2)
    loss, stats = policy_loss(logp, behaviour, adv, mask, cfg)
    # -min(r A, clip(r, 0.8, 1.2) A) per token
    objective = [min(R_HI * 2, 1.2 * 2), min(R_LO * 2, 0.8 * 2), min(-R_HI, -1.2), min(-R_LO, -0.8)]
    assert loss.item() == pytest.approx(-sum(objective) / 4, rel=1e-5)
    loss.backward()
    # clipped tokens (1st: r A > 1.2 A; 4th: r A > 0.8 A) give no gradient; others d(-r A)/dlogp =
    # -r A
    grad = [[0.0, -R_LO * 2 / 4], [R_HI / 4, 0.0]]
    assert logp.grad.tolist() == [pytest.approx(g, rel=1e-5, abs=1e-9) for g in grad]
    assert stats.clip_frac == pytest.approx(0.5)


@pytest.mark.parametrize("ratio", ["truncate", "clip", "decoupled"])
def test_masked_tokens_do_not_contribute(ratio: str):
    cfg = LossConfig(ratio=ratio)
    nan = float("nan")
    logp = torch.tensor([[-1.0, nan, -0.5], [float("-inf"), -0.7, nan]], requires_grad=True)
    behaviour = torch.tensor([[-1.1, float("nan"), -0.4], [float("-inf"), -0.9, 1e9]])
    mask = torch.tensor([[1, 0, 1], [0, 1, 0]])
    adv = torch.tensor([1.5, -0.5])
    loss, stats = policy_loss(logp, behaviour, adv, mask, cfg)
    loss.backward()
    assert torch.isfinite(loss)
    assert logp.grad[mask == 0].abs().max().item() == 0.0
    assert (logp.grad[mask == 1] != 0).all()
    assert stats.tokens == 3
    # the same loss as the unmasked tokens alone, flattened into one row
    keep = mask.bool()
    sub, _ = policy_loss(
        logp.detach()[keep][None],
        behaviour[keep][None],
        torch.tensor([[1.5, 1.5, -0.5]]),
        torch.ones(1, 3),
        cfg,
    )
    assert loss.item() == pytest.approx(sub.item(), rel=1e-6)


def test_the_norm_lets_micro_batches_add_up():
    cfg = LossConfig()
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.1], [-3.0, -1.0]])
    behaviour = logp + 0.1
    adv = torch.tensor([1.0, -2.0, 0.5])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    whole, _ = policy_loss(logp, behaviour, adv, mask, cfg)
    halves = (slice(0, 1), slice(1, 3))
    parts = [
        policy_loss(logp[s], behaviour[s], adv[s], mask[s], cfg, Norm(tokens=5, sequences=3))[0]
        for s in halves
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item(), rel=1e-6)


def test_kl_k3_term():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0]])
    adv, mask = torch.zeros(1), torch.ones(1, 2)
    k3 = [math.exp(-0.5) + 0.5 - 1.0, 0.0]  # exp(d) - d - 1, d = ref - logp
    loss, stats = policy_loss(logp, logp.detach(), adv, mask, LossConfig(kl_coef=0.5), ref_logp=ref)
    assert loss.item() == pytest.approx(0.5 * sum(k3) / 2, rel=1e-5)
    assert stats.kl == pytest.approx(sum(k3) / 2, rel=1e-5)
    # off by default: reported but not added
    loss0, stats0 = policy_loss(logp, logp.detach(), adv, mask, LossConfig(), ref_logp=ref)
    assert loss0.item() == 0.0
    assert stats0.kl == pytest.approx(stats.kl)


def test_decoupled_loss_hand_values():
    """Clip against the proximal policy, weight by the truncated behaviour ratio (AReaL's decoupled
    PPO)."""
    logp = torch.tensor(LOGP, requires_grad=True)
    prox = torch.tensor([[-1.2, -2.0], [-0.8, -2.0]])
    adv = torch.tensor([2.0, -1.0])
    cfg = LossConfig(ratio="decoupled", clip_eps_low=0.2, clip_eps_high=0.2, truncate_max=1.5)
    loss, stats = policy_loss(
        logp, torch.tensor(BEHAVIOUR), adv, torch.ones(2, 2), cfg, prox_logp=prox
    )
    r = [[math.exp(0.2), 1.0], [math.exp(-0.2), 1.0]]  # p_theta / p_prox
    # min(p_prox / p_engine, 1.5): e^0.7 is cut
    w = [[math.exp(0.3), math.exp(-1.0)], [1.5, math.exp(-1.0)]]
    a = [[2.0, 2.0], [-1.0, -1.0]]
    objective = [
        [min(r[i][j] * a[i][j], min(max(r[i][j], 0.8), 1.2) * a[i][j]) for j in range(2)]
        for i in range(2)
    ]
    expected = -sum(w[i][j] * objective[i][j] for i in range(2) for j in range(2)) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    loss.backward()
    # token (0, 0): r A = 2.44 > 1.2 A, the clip binds: no gradient; elsewhere d(-w r A)/dlogp = -w
    # r A
    grad = [[0.0, -w[0][1] * 1.0 * 2 / 4], [w[1][0] * r[1][0] / 4, w[1][1] / 4]]
    assert logp.grad.tolist() == [pytest.approx(g, rel=1e-5, abs=1e-9) for g in grad]
    # one clipped by the proximal clip, one by the weight cap
    assert stats.clip_frac == pytest.approx(0.5)
    # ratios stay p_trainer / p_engine
    assert stats.ratio_mean == pytest.approx((R_HI + R_LO) / 2, rel=1e-5)


def test_decoupled_default_proximal_is_this_step_and_keeps_stale_gradients():
    """Orbit takes one optimizer step per batch, so the proximal policy is the trainer's own
    logprob, detached: no token is clipped away for being stale, unlike `clip` against a drifted
    engine policy."""
    logp, behaviour, adv, mask = _inputs([2.0, -1.0])
    cfg = LossConfig(ratio="decoupled", truncate_max=1.5)
    loss, stats = policy_loss(logp, behaviour, adv, mask, cfg)
    loss.backward()
    w = [1.5, R_LO]
    grad = [[-w[0] * 2 / 4, -w[1] * 2 / 4], [w[0] / 4, w[1] / 4]]  # the truncate loss's gradient
    assert logp.grad.tolist() == [pytest.approx(g, rel=1e-5) for g in grad]
    clip = LossConfig(ratio="clip")
    logp2 = torch.tensor(LOGP, requires_grad=True)
    policy_loss(logp2, behaviour, adv, mask, clip)[0].backward()
    assert (logp2.grad == 0).sum() == 2 and (logp.grad != 0).all()


def test_truncated_logprobs_hand_values():
    """Logits [2, 1, 0, -1]: top_p 0.8 keeps {0, 1} (mass before token 2 is 0.88), top_k 3 keeps {0,
    1, 2}."""
    from orbit.rl.truncation import truncated_logprobs

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], requires_grad=True)
    logp = torch.log_softmax(logits, -1)
    got = truncated_logprobs(logp, torch.tensor([1]), top_p=0.8, top_k=0)
    assert got.item() == pytest.approx(-math.log(1 + math.e), rel=1e-6)  # e^1 / (e^2 + e^1)
    got.sum().backward()
    # the gradient carries the renormalisation: onehot(1) - softmax over the kept set only
    kept = [math.e**2 / (math.e**2 + math.e), math.e / (math.e**2 + math.e)]
    assert logits.grad.tolist()[0] == pytest.approx(
        [-kept[0], 1 - kept[1], 0.0, 0.0], rel=1e-5, abs=1e-7
    )
    assert truncated_logprobs(logp, torch.tensor([2]), 1.0, 3).item() == pytest.approx(
        -math.log(math.e**2 + math.e + 1), rel=1e-6
    )
    assert truncated_logprobs(logp, torch.tensor([1]), 1.0, 0).item() == pytest.approx(
        logp[0, 1].item()
    )
    # a target outside the kept set (numerics at the edge) widens it down to the target: finite, not
    # -inf
    assert truncated_logprobs(logp, torch.tensor([3]), 0.8, 0).item() == pytest.approx(
        -1.0 - math.log(math.e**2 + math.e + 1 + math.e**-1), rel=1e-6
    )


def test_truncated_entropy_hand_values_and_gradient():
    """-sum p log p of each row, as the elementwise formula gives it: untruncated (a row dot
    product), with a logit of -inf (its 0 x -inf dropped), and truncated to top_p 0.8's {0, 1};
    differentiable (an entropy bonus)."""
    from orbit.rl.truncation import truncated_entropy

    def plain(row: list[float]) -> float:
        z = sum(math.exp(x) for x in row)
        return -sum(math.exp(x) / z * (x - math.log(z)) for x in row if x > -math.inf)

    rows = [[2.0, 1.0, 0.0, -1.0], [0.5, -math.inf, 0.5, 0.0]]
    logits = torch.tensor(rows, requires_grad=True)
    got = truncated_entropy(torch.log_softmax(logits, -1), 1.0, 0)
    assert got.tolist() == pytest.approx([plain(r) for r in rows], rel=1e-6)
    got[0].backward()  # dH/dz_i = -p_i (log p_i + H)
    p = torch.softmax(logits[0].detach(), -1)
    want = -p * (p.log() + got[0].detach())
    assert logits.grad[0].tolist() == pytest.approx(want.tolist(), abs=1e-6)
    truncated = truncated_entropy(torch.log_softmax(logits.detach(), -1)[:1], 0.8, 0)
    assert truncated.item() == pytest.approx(plain([2.0, 1.0]), rel=1e-6)


def test_loss_on_truncated_logprobs_pins_the_sampled_policy():
    """Engine and trainer on the same truncated distribution: ratio 1, and the gradient is the
    truncated policy's: -A (onehot - kept softmax) / tokens, not the untruncated one's."""
    from orbit.rl.truncation import truncated_logprobs

    logits = torch.tensor([[[2.0, 1.0, 0.0, -1.0]]], requires_grad=True)  # one sample, one token
    logp = truncated_logprobs(
        torch.log_softmax(logits, -1), torch.tensor([[1]]), top_p=0.8, top_k=0
    )
    # what the engine reports for the sampled token
    behaviour = torch.tensor([[-math.log(1 + math.e)]])
    loss, stats = policy_loss(logp, behaviour, torch.tensor([2.0]), torch.ones(1, 1), LossConfig())
    assert stats.ratio_mean == pytest.approx(1.0, abs=1e-6)
    assert loss.item() == pytest.approx(2.0 * math.log(1 + math.e), rel=1e-6)
    loss.backward()
    kept = [math.e**2 / (math.e**2 + math.e), math.e / (math.e**2 + math.e)]
    assert logits.grad[0, 0].tolist() == pytest.approx(
        [2 * kept[0], -2 * (1 - kept[1]), 0.0, 0.0], rel=1e-5, abs=1e-7
    )
