"""Helper models live on the actor's layout: a data- or context-parallel actor's KL reference and gae critic
reproduce the 1-rank ones (gloo, real processes): the KL penalty, the critic's loss and its values after a step."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from molt.actor.group import init_distributed, run_actor
from molt.assets import ensure_model
from molt.config import EstimatorConfig, FsdpConfig, RunConfig, TrainConfig
from molt.net import free_port
from tests.actor.test_parallel import segments
from tests.ranks import spawn


def run_cfg(dp: int = 1, cp: int = 1):
    return OmegaConf.structured(RunConfig(
        estimator=EstimatorConfig(name="gae", critic_lr=1e-2), fsdp=FsdpConfig(dp_size=dp, cp_size=cp),
        train=TrainConfig(row_tokens=16, micro_batch_rows=1, lr=1e-2, kl_coef=0.5)))


def steps(actor) -> dict:
    segs, adv = segments(4)
    reference = actor.score(segs, ["reference"])["reference"]  # the frozen initial policy, scored on the layout
    for group in actor.optimizer.param_groups:  # the policy stays put: AdamW's first step moves every element by
        group["lr"] = 0.0                       # about +-lr whatever |g|, so layouts would differ by rounding
    first = actor.train_step(segs, adv)  # the reference equals the policy: KL 0
    with torch.no_grad():  # the same move of every element on any layout (a shard's elements are the whole's)
        for p in actor.model.parameters():
            p.add_(0.01)
    second = actor.train_step(segs, adv)
    returns = [[float(i % 2) * m for m in s.loss_mask] for i, s in enumerate(segs)]
    critic = [actor.train_helpers(segs, {"critic": returns}) for _ in range(2)]
    return {"reference": reference, "kl": (first["kl/ref_k3"], second["kl/ref_k3"]),
            "critic_loss": [c["critic/loss"] for c in critic],
            "values": actor.score(segs, ["critic"])["critic"]}


def _rank(rank, world, port, model_dir, dp, cp, out):
    torch.set_num_threads(1)
    device = init_distributed(rank, world, port, gpu=False)
    result = steps(run_actor(run_cfg(dp, cp), model_dir, device, mesh=True))
    if rank == 0:
        torch.save(result, out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model_dir = ensure_model(tmp_path_factory.mktemp("models") / "tiny", "tiny")
    torch.manual_seed(0)
    actor = run_actor(run_cfg(), model_dir)
    assert set(actor.helpers) == {"critic", "reference"}
    return model_dir, steps(actor)


@pytest.mark.parametrize("dp,cp", [(2, 1), (1, 2)])
def test_helpers_follow_the_layout(setup, tmp_path, dp, cp):
    model_dir, ref = setup
    out = tmp_path / "rank0.pt"
    spawn(_rank, args=(dp * cp, free_port(), str(model_dir), dp, cp, str(out)), nprocs=dp * cp)
    got = torch.load(out, weights_only=False)
    for a, b in zip(got["reference"], ref["reference"]):
        assert a == pytest.approx(b, abs=1e-5)
    assert ref["kl"][0] == pytest.approx(0.0, abs=1e-7) and ref["kl"][1] > 1e-5
    assert got["kl"] == pytest.approx(ref["kl"], rel=1e-4, abs=1e-8)
    assert ref["critic_loss"][1] < ref["critic_loss"][0]
    assert got["critic_loss"] == pytest.approx(ref["critic_loss"], rel=1e-4)
    for a, b in zip(got["values"], ref["values"]):
        assert a == pytest.approx(b, abs=1e-5)
