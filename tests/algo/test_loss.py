import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from molt.algo.loss import LOSSES, Objective, combine, kl_penalty
from molt.config import REPO, IsCorrectionConfig, LossConfig

PPO = LossConfig()  # ppo_clip, band [0.8, 1.28]


def policy_loss(logp, old, adv, mask, num_loss_tokens, clip_low=0.2, clip_high=0.28, weight=None):
    return LOSSES["ppo_clip"](logp, old, adv, mask, torch.zeros_like(mask).long(), num_loss_tokens,
                              LossConfig(clip_low=clip_low, clip_high=clip_high), weight)
from molt.types import Batch


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


def loss_config(name: str) -> LossConfig:
    """The loss's shipped settings (conf/loss/<name>.yaml)."""
    node = OmegaConf.load(Path(REPO, "conf", "loss", f"{name}.yaml"))
    return LossConfig(**{k: v for k, v in node.items() if k != "defaults"})


def _packed_rows():
    """4 packed rows as the actor's micro-batches see them: 6 segments (-1: padding), prompt tokens off the mask,
    one advantage per segment, log-ratios spread around 0 so that some tokens and sequences leave every band."""
    g = torch.Generator().manual_seed(0)
    segs = torch.tensor([[0, 0, 0, 1, 1, -1], [2, 2, 2, 2, 2, 2], [3, 3, 4, 4, 4, -1], [5, 5, 5, 5, -1, -1]])
    mask = ((segs >= 0) & (torch.rand(segs.shape, generator=g) > 0.2)).float()  # (R, T)
    old = -3 * torch.rand(segs.shape, generator=g)  # (R, T)
    logp = old + 0.3 * torch.randn(segs.shape, generator=g)  # (R, T)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.0, 0.7, 1.5])[segs.clamp(min=0)] * mask  # (R, T)
    weight = 0.5 + torch.rand(segs.shape, generator=g)  # IS weights, as Objective passes them
    return logp, old, adv, mask, segs, weight


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_every_loss_sums_over_micro_batches(name):
    """The contract of a LOSSES entry: summed over micro-batches of whole rows (a segment never spans rows) with
    the batch's num_loss_tokens, its loss, gradient and metrics are the whole batch's, for any split."""
    cfg, (logp, old, adv, mask, segs, weight) = loss_config(name), _packed_rows()

    def accumulate(split):
        lp, total, metrics = logp.clone().requires_grad_(), 0.0, {}
        for rows in torch.arange(len(segs)).split(split):
            loss, m = LOSSES[name](lp[rows], old[rows], adv[rows], mask[rows], segs[rows], int(mask.sum()), cfg,
                                   weight[rows])
            loss.backward()
            total, metrics = total + loss.item(), combine(metrics, m)
        return total, lp.grad, metrics

    whole, grad, metrics = accumulate([4])
    assert 0 < metrics["clip/frac"] < 1 and grad.abs().sum() > 0  # the split has something to change
    for split in ([1, 1, 1, 1], [2, 2], [3, 1], [1, 3]):
        total, g, m = accumulate(split)
        assert total == pytest.approx(whole, abs=1e-6), split
        torch.testing.assert_close(g, grad, rtol=0, atol=1e-7)
        assert {k: v.item() for k, v in m.items()} == pytest.approx({k: v.item() for k, v in metrics.items()},
                                                                    abs=1e-6)


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


def test_gspo_hand_worked():
    """Sequence 0 (2 tokens, log-ratios .2 and .4): s = e^.3 = 1.3499 > 1.28 with A = 1, clipped, no gradient;
    sequence 1 (1 token, log-ratio -.1): s = e^-.1 = .9048 inside the band with A = -1."""
    old = torch.tensor([[-1.0, -1.0, -2.0, -1.0]])
    logp = (old + torch.tensor([[0.2, 0.4, -0.1, 5.0]])).requires_grad_()
    adv, mask = torch.tensor([[1.0, 1.0, -1.0, 9.0]]), torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # last: off the mask
    segs = torch.tensor([[0, 0, 1, 1]])
    loss, m = LOSSES["gspo"](logp, old, adv, mask, segs, 3, LossConfig(clip_low=0.2, clip_high=0.28))
    assert loss.item() == pytest.approx((-1.28 * 2 + math.exp(-0.1)) / 3, abs=1e-6)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([0.0, 0.0, math.exp(-0.1) / 3, 0.0], abs=1e-6)
    assert m["clip/frac"].item() == pytest.approx(2 / 3) and m["clip/high_frac"].item() == pytest.approx(2 / 3)
    # a wide band: both tokens of sequence 0 get the SEQUENCE ratio's gradient, -s A / n (PPO: e^.2 and e^.4)
    logp.grad = None
    LOSSES["gspo"](logp, old, adv, mask, segs, 3, LossConfig(clip_low=0.9, clip_high=9.0))[0].backward()
    assert logp.grad[0, :2].tolist() == pytest.approx([-math.exp(0.3) / 3] * 2, abs=1e-6)


def test_cispo_hand_worked():
    """Weights sg(clip(r, 1 - 1, 1 + .28)) = [1, 1.28 (r = e^.5), e^-.5 (no lower bound), 1.28 (r = 1.5)]; the
    gradient of every token is -w A / n, also where PPO would clip it to zero."""
    old = torch.full((1, 4), -1.0)
    logp = (old + torch.tensor([[0.0, 0.5, -0.5, math.log(1.5)]])).requires_grad_()
    adv, mask, segs = torch.tensor([[1.0, 1.0, -1.0, 2.0]]), torch.ones(1, 4), torch.zeros(1, 4).long()
    loss, m = LOSSES["cispo"](logp, old, adv, mask, segs, 4, LossConfig(clip_low=1.0, clip_high=0.28))
    w = [1.0, 1.28, math.exp(-0.5), 1.28]
    lp = logp.detach()[0].tolist()
    assert loss.item() == pytest.approx(-sum(wi * a * x for wi, a, x in zip(w, [1, 1, -1, 2], lp)) / 4, abs=1e-6)
    assert loss.item() == pytest.approx(0.5630535, abs=1e-6)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-1 / 4, -1.28 / 4, math.exp(-0.5) / 4, -2.56 / 4], abs=1e-6)
    assert m["clip/frac"].item() == pytest.approx(2 / 4) and m["clip/low_frac"].item() == 0.0


def test_every_loss_has_a_config_file():
    assert {p.stem for p in Path(REPO, "conf", "loss").glob("*.yaml")} == set(LOSSES)


def test_kl_penalty_hand_worked():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, m = kl_penalty(logp, ref, mask, num_loss_tokens=2, kl_coef=0.1)
    k3 = (math.exp(1.0) - 1.0 - 1) / 2  # token 0: d = 0 -> 0; token 1: d = 1; token 2 is off the mask
    assert m["kl/ref_k3"].item() == pytest.approx(k3) and loss.item() == pytest.approx(0.1 * k3)
    loss.backward()  # d/dlogp k3 = 1 - exp(ref - logp)
    assert logp.grad[0].tolist() == pytest.approx([0.0, 0.1 * (1 - math.e) / 2, 0.0])


def _mb(logp, behaviour, adv, mask, segs):
    return Batch(input_ids=torch.zeros_like(segs), position_ids=torch.zeros_like(segs), loss_mask=mask,
                 behaviour_logp=behaviour, advantages=adv, segment_ids=segs)


def test_objective_with_is_weights_and_kl():
    """IS on: the gradient is -w_t A_t / n per token (gated tokens: 0), plus the KL term; ratios vs the proximal
    policy are 1, so the clip never fires."""
    behaviour = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    log_ratio = torch.tensor([[0.0, math.log(1.5), math.log(3.0), math.log(0.8)]])
    logp = (behaviour + log_ratio).requires_grad_()
    adv, mask, segs = torch.tensor([[0.0, 2.0, 2.0, -1.0]]), torch.tensor([[0.0, 1, 1, 1]]), torch.zeros(1, 4).long()
    ref = logp.detach() + torch.tensor([[0.0, 0.0, 0.0, 0.5]])
    objective = Objective(PPO, IsCorrectionConfig(level="token", mode="mask", low=0.5, high=2.0), kl_coef=0.2)
    assert objective.needs == ("reference",)
    loss, m = objective(logp, torch.tensor([[9.0, 1.0, 2.0, 3.0]]), _mb(logp, behaviour, adv, mask, segs), 3, 1,
                        reference=ref)
    loss.backward()
    kl_grad = 0.2 * (1 - math.exp(0.5)) / 3  # last token only: d = 0.5
    assert logp.grad[0].tolist() == pytest.approx([0.0, -1.5 * 2 / 3, 0.0, 0.8 / 3 + kl_grad], abs=1e-6)
    assert loss.item() == pytest.approx((-1.5 * 2 + 0.8) / 3 + 0.2 * (math.exp(0.5) - 1.5) / 3, abs=1e-6)
    assert m["clip/frac"] == 0 and m["ratio/mean"].item() == pytest.approx(1.0)
    assert m["entropy/mean"].item() == pytest.approx(2.0) and m["is/token_gated_frac"].item() == pytest.approx(1 / 3)
    assert m["is/ratio_max"].item() == pytest.approx(3.0)


def test_objective_without_correction_is_ppo_against_behaviour():
    logp, behaviour, adv, mask = _case()
    segs = torch.zeros_like(mask).long()
    objective = Objective(PPO, IsCorrectionConfig())
    assert objective.needs == ()
    loss, m = objective(logp, torch.zeros_like(logp), _mb(logp, behaviour, adv, mask, segs), 8, 1)
    assert loss.item() == pytest.approx(policy_loss(logp, behaviour, adv, mask, 8, 0.2, 0.28)[0].item())
    assert "kl/ref_k3" not in m and "is/token_gated_frac" not in m and m["is/ratio_min"] > 0


def test_combine_sums_and_keeps_extremes():
    t = combine({}, {"a": torch.tensor(1.0), "x_min": torch.tensor(2.0), "x_max": torch.tensor(2.0)})
    t = combine(t, {"a": torch.tensor(0.5), "x_min": torch.tensor(1.0), "x_max": torch.tensor(1.0)})
    assert {k: v.item() for k, v in t.items()} == {"a": 1.5, "x_min": 1.0, "x_max": 2.0}
