import math

import pytest
import torch

from molt.algo.advantages import ESTIMATORS, GROUP_BASELINE, compute_advantages, grpo
from molt.algo.loss import policy_loss
from molt.config import EstimatorConfig

REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 0.5, 1.0, 0.0, 0.0])
GROUPS = torch.tensor([7, 7, 3, 7, 7, 3, 9, 9, 9])  # groups interleaved and not numbered 0..G-1


def test_grpo_hand_worked():
    # group 7: [1,0,0,1], mean 1/2, std 1/2; group 3: [.5,.5], std 0 -> 0 (eps keeps it finite);
    # group 9: [1,0,0], mean 1/3, std sqrt(2)/3
    a, b, e = 0.5 / (0.5 + 1e-6), 1 / 3 / (math.sqrt(2) / 3 + 1e-6), 1e-6
    expected = torch.tensor([a, -a, 0, -a, a, 0, 2 * b, -b, -b])
    torch.testing.assert_close(grpo(REWARDS, GROUPS, eps=e), expected, rtol=0, atol=1e-7)
    assert grpo(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), eps=0.0).tolist() == [1.0, -1.0]


def test_dr_grpo_hand_worked():
    expected = torch.tensor([0.5, -0.5, 0, -0.5, 0.5, 0, 2 / 3, -1 / 3, -1 / 3])
    torch.testing.assert_close(grpo(REWARDS, GROUPS, std_normalize=False), expected)


def test_compute_advantages_dispatch():
    cfg = EstimatorConfig(name="grpo", std_normalize=False)
    torch.testing.assert_close(compute_advantages(cfg, REWARDS.tolist(), GROUPS.tolist()),
                               grpo(REWARDS, GROUPS, std_normalize=False))
    with pytest.raises(ValueError, match=r"estimator.name='nope'.*\['grpo'\]"):
        compute_advantages(EstimatorConfig(name="nope"), REWARDS, GROUPS)
    assert GROUP_BASELINE <= set(ESTIMATORS)


def _case():
    diff = torch.tensor([[0.0, 0.5, -0.5, math.log(1.1), 3.0]])  # logp - behaviour
    behaviour = torch.tensor([[-1.0, -2.0, -0.5, -1.5, -4.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0, 2.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])  # the last token must be ignored
    return behaviour + diff, behaviour, adv, mask


def test_policy_loss_hand_worked():
    logp, behaviour, adv, mask = _case()
    loss, m = policy_loss(logp, behaviour, adv, mask, num_loss_tokens=8, clip_low=0.2, clip_high=0.28)
    # per token: -1 (r=1), -1.28 (r=e^.5 clipped at 1.28), +0.8 (r=e^-.5, A<0: clipped at 0.8), -2.2 (r=1.1)
    assert loss.item() == pytest.approx((-1 - 1.28 + 0.8 - 2.2) / 8, abs=1e-6)
    assert m["clip/frac"].item() == pytest.approx(2 / 8)
    assert m["clip/high_frac"].item() == pytest.approx(1 / 8) and m["clip/low_frac"].item() == pytest.approx(1 / 8)
    assert m["ratio/mean"].item() == pytest.approx((1 + math.exp(0.5) + math.exp(-0.5) + 1.1) / 8, abs=1e-6)


def test_policy_loss_sums_over_micro_batches():
    logp, behaviour, adv, mask = _case()
    whole, _ = policy_loss(logp, behaviour, adv, mask, 4, 0.2, 0.28)
    halves = [policy_loss(logp[:, s], behaviour[:, s], adv[:, s], mask[:, s], 4, 0.2, 0.28)[0]
              for s in (slice(0, 2), slice(2, 5))]
    assert (halves[0] + halves[1]).item() == pytest.approx(whole.item(), abs=1e-7)


@pytest.mark.parametrize("adv, ratio, has_grad", [
    (1.0, 1.28 - 1e-3, True), (1.0, 1.28 + 1e-3, False),  # A>0: no push beyond 1 + clip_high
    (1.0, 0.5, True),  # A>0 below the band: the unclipped term is the minimum, keep pushing up
    (-1.0, 0.8 + 1e-3, True), (-1.0, 0.8 - 1e-3, False),  # A<0: no push below 1 - clip_low
    (-1.0, 1.5, True),  # A<0 above the band: pessimistic bound still pulls it down
])
def test_clip_band_edges(adv, ratio, has_grad):
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, m = policy_loss(logp, torch.zeros(1, 1), torch.tensor([[adv]]), torch.ones(1, 1), 1, 0.2, 0.28)
    loss.backward()
    assert (logp.grad.abs().item() > 0) == has_grad
    assert m["clip/frac"].item() == (0.0 if has_grad else 1.0)
    if has_grad:  # d/dlogp of -ratio * A = -ratio * A
        assert logp.grad.item() == pytest.approx(-ratio * adv, rel=1e-5)
