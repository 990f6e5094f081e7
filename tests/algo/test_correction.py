"""IS weights, gates and modes on constructed ratios, worked out by hand."""
import math

import pytest
import torch

from molt.algo.correction import behaviour_metrics, is_weights
from molt.config import IsCorrectionConfig

# row 0: seg0 = [prompt, 1.0, 3.0, .9], seg1 = [prompt, 1.2, .4]; row 1: seg2 = [prompt, 3, 3], seg3 = [prompt, 1.1], pad
RATIO = torch.tensor([[1.0, 1.0, 3.0, 0.9, 1.0, 1.2, 0.4], [1.0, 3.0, 3.0, 1.0, 1.1, 1.0, 1.0]])
MASK = torch.tensor([[0, 1, 1, 1, 0, 1, 1], [0, 1, 1, 0, 1, 0, 0]], dtype=torch.float32)
SEGS = torch.tensor([[0, 0, 0, 0, 1, 1, 1], [2, 2, 2, 3, 3, -1, -1]])
# per segment: product 2.7, .48, 9, 1.1 (band [.5, 2] keeps only seg3); geometric mean 1.39, .69, 3, 1.1 (drops seg2)
CASES = {  # (level, mode): (weights, token share acted on, sequence share gated)
    ("token", "mask"): ([[0, 1, 0, .9, 0, 1.2, 0], [0, 0, 0, 0, 1.1, 0, 0]], 4 / 8, 0.0),
    ("token", "clip"): ([[0, 1, 2, .9, 0, 1.2, .5], [0, 2, 2, 0, 1.1, 0, 0]], 4 / 8, 0.0),
    ("token", "trunc"): ([[0, 1, 2, .9, 0, 1.2, .4], [0, 2, 2, 0, 1.1, 0, 0]], 3 / 8, 0.0),
    ("seq", "mask"): ([[0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 1.1, 0, 0]], 7 / 8, 3 / 4),
    ("geo", "mask"): ([[0, 1, 3, .9, 0, 1.2, .4], [0, 0, 0, 0, 1.1, 0, 0]], 2 / 8, 1 / 4),
}


@pytest.mark.parametrize("level,mode", list(CASES), ids=[f"{a}-{b}" for a, b in CASES])
def test_weights_hand_worked(level, mode):
    weights, token_frac, seq_frac = CASES[(level, mode)]
    cfg = IsCorrectionConfig(level=level, mode=mode, low=0.5, high=2.0)
    w, m = is_weights(RATIO.log(), MASK, SEGS, cfg, num_loss_tokens=8, num_sequences=4)
    torch.testing.assert_close(w, torch.tensor(weights))
    assert m["is/token_gated_frac"].item() == pytest.approx(token_frac)
    assert m["is/seq_gated_frac"].item() == pytest.approx(seq_frac)


def test_off_gives_no_weights():
    assert is_weights(RATIO.log(), MASK, SEGS, IsCorrectionConfig(level="off"), 8, 4) == (None, {})
    assert is_weights(RATIO.log(), MASK, SEGS, None, 8, 4) == (None, {})


def test_long_sequence_product_does_not_overflow():
    """A product of 400 ratios of 2 is 2^400 (inf in fp32): the gate works in log space."""
    log_ratio = torch.full((1, 401), math.log(2.0))
    mask = torch.ones(1, 401)
    mask[0, 0] = 0
    w, m = is_weights(log_ratio, mask, torch.zeros(1, 401, dtype=torch.long),
                      IsCorrectionConfig(level="seq", low=0.5, high=2.0), 400, 1)
    assert w.abs().sum() == 0 and m["is/seq_gated_frac"] == 1.0
    w, _ = is_weights(log_ratio, mask, torch.zeros(1, 401, dtype=torch.long),
                      IsCorrectionConfig(level="geo", low=0.5, high=2.0), 400, 1)
    assert w[0, 1:].tolist() == pytest.approx([2.0] * 400)  # geometric mean 2 is on the band's edge: kept


def test_behaviour_metrics_hand_worked():
    m = behaviour_metrics(RATIO.log(), MASK, num_loss_tokens=8)
    kept = [1.0, 3.0, 0.9, 1.2, 0.4, 3.0, 3.0, 1.1]
    assert m["is/ratio_min"].item() == pytest.approx(0.4) and m["is/ratio_max"].item() == pytest.approx(3.0)
    assert m["is/ratio_mean"].item() == pytest.approx(sum(kept) / 8)
    assert m["kl/behaviour_k3"].item() == pytest.approx(sum(r - 1 - math.log(r) for r in kept) / 8, rel=1e-6)
