"""Advantages and the policy loss against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from orbit.config import LossConfig
from orbit.train.loss import group_advantages, policy_loss

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
    cfg = LossConfig(ratio="clip", clip_eps=0.2)
    loss, stats = policy_loss(logp, behaviour, adv, mask, cfg)
    # -min(r A, clip(r, 0.8, 1.2) A) per token
    objective = [min(R_HI * 2, 1.2 * 2), min(R_LO * 2, 0.8 * 2), min(-R_HI, -1.2), min(-R_LO, -0.8)]
    assert loss.item() == pytest.approx(-sum(objective) / 4, rel=1e-5)
    loss.backward()
    # clipped tokens (1st: r A > 1.2 A; 4th: r A > 0.8 A) give no gradient; others d(-r A)/dlogp = -r A
    grad = [[0.0, -R_LO * 2 / 4], [R_HI / 4, 0.0]]
    assert logp.grad.tolist() == [pytest.approx(g, rel=1e-5, abs=1e-9) for g in grad]
    assert stats.clip_frac == pytest.approx(0.5)


@pytest.mark.parametrize("ratio", ["truncate", "clip"])
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
        logp.detach()[keep][None], behaviour[keep][None], torch.tensor([[1.5, 1.5, -0.5]]), torch.ones(1, 3), cfg
    )
    assert loss.item() == pytest.approx(sub.item(), rel=1e-6)


def test_num_tokens_lets_micro_batches_add_up():
    cfg = LossConfig()
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.1], [-3.0, -1.0]])
    behaviour = logp + 0.1
    adv = torch.tensor([1.0, -2.0, 0.5])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    whole, _ = policy_loss(logp, behaviour, adv, mask, cfg)
    halves = (slice(0, 1), slice(1, 3))
    parts = [policy_loss(logp[s], behaviour[s], adv[s], mask[s], cfg, num_tokens=5)[0] for s in halves]
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
