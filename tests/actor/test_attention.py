import pytest
import torch

from molt.actor import attention
from molt.actor.actor import load_model, token_logprobs
from molt.actor.pack import micro_batches, pack
from molt.assets import ensure_model
from tests.actor.test_actor import make_segments


@pytest.fixture(scope="module", params=["tiny", "tiny_moe"])
def model_dir(request, tmp_path_factory):
    return ensure_model(tmp_path_factory.mktemp("assets") / request.param, request.param)


def _loss_and_grads(model, batch):
    logp = token_logprobs(model, batch, temperature=0.7, loss_only=True)  # (R, T)
    loss = (logp * batch.advantages).sum()
    loss.backward()
    return logp.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_blocks_from_position_runs():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
    assert attention.blocks(pos) == [[(0, 3, 0, 0), (3, 5, 3, 0), (5, 6, 5, 0)], [(0, 4, 0, 0), (4, 6, 4, 0)]]
    shared = torch.tensor([[0, 1, 2, 3, 2, 3, 4, 2, 3, 0, 1]])  # a prefix of 2 shared by three runs, then padding
    assert attention.blocks(shared) == [[(0, 4, 0, 0), (4, 7, 0, 2), (7, 9, 0, 2), (9, 11, 9, 0)]]


def test_varlen_matches_masked_sdpa(model_dir):
    """Per-segment attention gives the dense block-diagonal mask's log-probs, loss and gradients (padded rows too)."""
    segs = make_segments()
    batch = pack(segs, [[(i % 3) - 1.0] * len(s.token_ids) for i, s in enumerate(segs)], row_tokens=32)
    mb = micro_batches(batch, 2)[1]  # two rows of different fill: the shorter one ends in a padding segment
    assert (mb.segment_ids == -1).any() and (mb.position_ids == 0).sum() > 2 * mb.num_rows
    ref_lp, ref_loss, ref = _loss_and_grads(load_model(model_dir, "float32", "sdpa", "cpu"), mb)
    lp, loss, grads = _loss_and_grads(load_model(model_dir, "float32", attention.NAME, "cpu"), mb)
    assert (lp - ref_lp).abs().max() <= 1e-5
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-5)
    assert grads.keys() == ref.keys() and len(ref) > 0
    for name in ref:  # atol: fp32 sums in another order, relative to the largest entry (a few units); a mask that
        # let one segment see another moves gradients by orders of magnitude more
        scale = ref[name].abs().max().item()
        torch.testing.assert_close(grads[name], ref[name], rtol=1e-4, atol=1e-6 * max(scale, 1.0), msg=name)


def test_runs_on_a_shared_prefix_are_batched_within_the_mask_budget(monkeypatch):
    runs = [(10, 14), (14, 20), (20, 22), (22, 30)]
    assert attention._batches(runs, 10) == [runs]
    monkeypatch.setattr(attention, "MASK_ELEMENTS", 2 * 6 * 16)  # two runs of up to 6 tokens after 10 shared
    assert attention._batches(runs, 10) == [[(10, 14), (14, 20)], [(20, 22)], [(22, 30)]]
