"""Every parallel layout reproduces 1-rank training: loss, full gradients, the step, log-probs (gloo, real processes).

The batch is 4 packed rows (one segment per row) and train.micro_batch_rows=1, so the 1-rank reference is
dp=1 x ga=4, the dp2 layouts are dp=2 x ga=2 and dp4 is dp=4 x ga=1: matching gradients across them is the
global token-mean property. A 3-row batch on 4 data shards exercises the padding micro-batch. The LoRA layouts
(lora.rank > 0: adapters on the attention, the head and final norm trained in full, the rest of the base frozen)
reproduce 1-rank LoRA the same way, and only those have gradients.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist

from molt.actor.actor import Actor
from molt.actor.group import init_distributed, rank_actor
from molt.actor.parallel import full_tensors
from molt.assets import ensure_model
from molt.config import FsdpConfig, LoraConfig, TrainConfig
from molt.net import free_port
from molt.types import Segment
from tests.ranks import spawn

TRAIN = TrainConfig(row_tokens=16, micro_batch_rows=1, lr=1e-3, grad_clip=1.0)
HAS_CP = importlib.util.find_spec("molt.actor.context") is not None


def segments(rows: int) -> tuple[list[Segment], list[float]]:
    """`rows` segments of 9-13 tokens: with row_tokens=16 no two share a row, so they pack into `rows` rows."""
    g = torch.Generator().manual_seed(rows)
    out = []
    for i in range(rows):
        prompt, gen = 4 + i % 3, 5 + i % 2
        s = Segment()
        s.append(torch.randint(3, 300, (prompt,), generator=g).tolist())
        s.append(torch.randint(3, 300, (gen,), generator=g).tolist(), generated=True,
                 logprobs=(-3 * torch.rand(gen, generator=g)).tolist(), version=0)
        out.append(s)
    return out, [float(i % 3) - 1.0 for i in range(rows)]


def run_steps(actor, rows: int) -> dict:
    segs, adv = segments(rows)
    metrics = actor.train_step(segs, adv)
    return {"metrics": metrics, "grads": full_tensors(actor.model, grads=True) if actor.mesh else
            {n: p.grad.clone() for n, p in actor.model.named_parameters() if p.grad is not None},
            "weights": actor.export_weights(), "logprobs": actor.logprobs(segs)}


def _rank(rank, world, port, model_dir, fsdp, rows, out, lora=None):
    torch.set_num_threads(1)
    actor = rank_actor(model_dir, TRAIN, fsdp, init_distributed(rank, world, port, gpu=False), lora_cfg=lora)
    result = run_steps(actor, rows)
    if rank == 0:
        torch.save(result, out)
    dist.barrier()  # no rank tears its gloo threads down while a peer still talks to it
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("models")
    return {name: ensure_model(tmp / name, name) for name in ("tiny", "tiny_moe")}


@pytest.fixture(scope="module")
def reference(models):
    """1-rank training: the numerical reference, per (model, rows)."""
    torch.manual_seed(0)
    cache = {}

    def get(name, rows, lora=None):
        if (name, rows, repr(lora)) not in cache:
            cache[name, rows, repr(lora)] = run_steps(Actor(models[name], TRAIN, lora_cfg=lora), rows)
        return cache[name, rows, repr(lora)]
    return get


SAVED = ("lm_head.weight", "model.norm.weight")  # LORA trains them in full beside the adapters
LORA = LoraConfig(rank=4, alpha=8.0, seed=3, modules_to_save=["lm_head", "model.norm"])
LAYOUTS = [  # (model, dp, ep, cp, offload, rows, lora)
    ("tiny", 2, 1, 1, "none", 4, None),  # dp=2 x ga=2
    ("tiny", 4, 1, 1, "none", 4, None),  # dp=4 x ga=1
    ("tiny_moe", 1, 2, 1, "none", 4, None),
    ("tiny_moe", 2, 2, 1, "none", 3, None),  # 4 data shards, 3 rows: one shard runs a padding micro-batch
    ("tiny", 2, 1, 1, "optimizer", 4, None),
    pytest.param("tiny", 1, 1, 2, "none", 4, None, marks=pytest.mark.skipif(not HAS_CP, reason="no context.py")),
    pytest.param("tiny_moe", 1, 2, 2, "none", 4, None, marks=pytest.mark.skipif(not HAS_CP, reason="no context.py")),
    pytest.param("tiny", 2, 1, 1, "none", 3, LORA, id="tiny-lora-dp2"),  # 2 data shards, 3 rows: one pads
    pytest.param("tiny_moe", 1, 2, 2, "none", 4, LORA, id="tiny_moe-lora-ep2-cp2",
                 marks=pytest.mark.skipif(not HAS_CP, reason="no context.py")),
]


@pytest.mark.parametrize("name,dp,ep,cp,offload,rows,lora", LAYOUTS)
def test_layout_reproduces_one_rank(models, reference, tmp_path, name, dp, ep, cp, offload, rows, lora):
    fsdp = FsdpConfig(dp_size=dp, ep_size=ep, cp_size=cp, offload=offload)
    out = tmp_path / "rank0.pt"
    spawn(_rank, args=(dp * ep * cp, free_port(), str(models[name]), fsdp, rows, str(out), lora), nprocs=dp * ep * cp)
    got, ref = torch.load(out, weights_only=False), reference(name, rows, lora)
    assert ref["metrics"]["rows"] == rows
    for key in ("loss/policy", "grad_norm", "tokens/loss", "entropy/mean", "mismatch/logprob_abs_max"):
        assert got["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-5, abs=1e-7), key
    assert got["grads"].keys() == ref["grads"].keys()
    if lora is not None:  # LoRA: the base stays frozen but for modules_to_save
        assert {n for n in ref["grads"] if ".lora_" not in n} == set(SAVED)
    for n, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][n], g, rtol=1e-4, atol=1e-7, msg=lambda m: f"grad {n}: {m}")
    assert got["weights"].keys() == ref["weights"].keys()
    # after clip + AdamW on the shards (on the host with offload). AdamW's first update is lr * g / (|g| + eps),
    # about +-lr whatever |g|, so a gradient of ~1e-8 that differs by fp32 rounding moves a weight by a fraction
    # of lr: the bound is 5% of lr (a wrong step is off by ~lr).
    for n, w in ref["weights"].items():
        torch.testing.assert_close(got["weights"][n], w, rtol=0, atol=0.05 * TRAIN.lr, msg=lambda m: f"weight {n}: {m}")
    for a, b in zip(got["logprobs"], ref["logprobs"]):
        assert a == pytest.approx(b, abs=1e-5)
