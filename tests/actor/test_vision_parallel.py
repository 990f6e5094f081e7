"""The vision-language actor under FSDP2: dp2 on gloo (real processes) reproduces 1-rank training with images in
the packed rows (loss, gradients of the vision tower included, log-probs); train.freeze_vision keeps it fixed.

Four segments pack into 3 rows of 48 tokens (two segments and two images share row 1), so one data shard also
runs a padding micro-batch without images: the vision tower must still run there (vision.inputs says why)."""
from __future__ import annotations

import hashlib
import io

import numpy as np
import pytest
import torch
import torch.distributed as dist
from PIL import Image as PIL

from molt.actor.actor import Actor
from molt.actor.group import init_distributed, rank_actor
from molt.actor.parallel import full_tensors
from molt.assets import VL_IMAGE, ensure_model
from molt.config import FsdpConfig, TrainConfig
from molt.net import free_port
from molt.types import Image, Segment
from tests.ranks import spawn

TRAIN = TrainConfig(row_tokens=48, micro_batch_rows=1, lr=1e-3, grad_clip=1.0)
SEQ = (VL_IMAGE["image_size"] // VL_IMAGE["patch_size"]) ** 2 // VL_IMAGE["scale_factor"] ** 2


def png(seed: int) -> bytes:
    b = io.BytesIO()
    PIL.fromarray(np.random.RandomState(seed).randint(0, 255, (40, 60, 3), dtype=np.uint8)).save(b, "PNG")
    return b.getvalue()


def segments(image_token: int, rows: int = 4) -> tuple[list[Segment], list[float]]:
    """`rows` segments of 2 + 16 image tokens (seg 0: twice) + 4-6 generated tokens, one of them the image token."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(rows):
        s, n_img = Segment(), 2 if i == 0 else 1
        for k in range(n_img):
            data = png(10 * i + k)
            s.append(torch.randint(7, 300, (2,), generator=g).tolist() + [image_token] * SEQ,
                     images=[Image(2, SEQ, hashlib.sha256(data).hexdigest(), data)])
        gen = 4 + i % 3
        ids = torch.randint(7, 300, (gen,), generator=g).tolist()
        ids[1] = image_token if i == 1 else ids[1]  # a policy may generate the image token id: it stays a token
        s.append(ids, generated=True,
                 logprobs=(-3 * torch.rand(gen, generator=g)).tolist(), version=0)
        out.append(s)
    return out, [float(i % 3) - 1.0 for i in range(rows)]


def run_step(actor) -> dict:
    segs, adv = segments(actor.model.config.image_token_id)
    metrics = actor.train_step(segs, adv)
    grads = full_tensors(actor.model, grads=True) if actor.mesh else {
        n: p.grad.clone() for n, p in actor.model.named_parameters() if p.grad is not None}
    return {"metrics": metrics, "grads": grads, "logprobs": actor.logprobs(segs)}


def _rank(rank, world, port, model_dir, out):
    torch.set_num_threads(1)
    actor = rank_actor(model_dir, TRAIN, FsdpConfig(dp_size=world), init_distributed(rank, world, port, gpu=False))
    result = run_step(actor)
    if rank == 0:
        torch.save(result, out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return ensure_model(tmp_path_factory.mktemp("m") / "tiny_vl", "tiny_vl")


def test_vl_dp2_reproduces_one_rank(vl_dir, tmp_path):
    torch.manual_seed(0)
    ref = run_step(Actor(vl_dir, TRAIN))
    assert any("vision_model" in n and g.abs().sum() > 0 for n, g in ref["grads"].items())  # the tower trains
    out = tmp_path / "rank0.pt"
    spawn(_rank, args=(2, free_port(), str(vl_dir), str(out)), nprocs=2)
    got = torch.load(out, weights_only=False)
    for key in ("loss/policy", "grad_norm", "tokens/loss"):
        assert got["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-5, abs=1e-7), key
    assert got["grads"].keys() == ref["grads"].keys()
    for n, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][n], g, rtol=1e-4, atol=1e-7, msg=lambda m: f"grad {n}: {m}")
    for a, b in zip(got["logprobs"], ref["logprobs"]):
        assert a == pytest.approx(b, abs=1e-5)


def test_freeze_vision_keeps_the_tower(vl_dir):
    actor = Actor(vl_dir, TrainConfig(row_tokens=48, freeze_vision=True))
    before = {n: p.clone() for n, p in actor.model.named_parameters()}
    run_step(actor)
    moved = {n for n, p in actor.model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and not any("vision_model" in n or "connector" in n for n in moved)
