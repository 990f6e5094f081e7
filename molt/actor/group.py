"""The run's actor (`run_actor`) and the multi-rank actor: world-size ranks, each an `Actor` on one shared
DeviceMesh, driven as one actor.

    group = ActorGroup(cfg, model_dir)                   # Ray actors (num_cpus=0), gloo on CPU / NCCL on GPU
    metrics = group.train_step(segments, advantages, t)  # every rank gets the whole batch, trains its shard

Without Ray (tests, torchrun on the GPU machine), each process calls `init_distributed()` and builds
`rank_actor(...)` itself. Every Actor method is a collective: all ranks call it, in the same order.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from molt.actor import helpers
from molt.actor.actor import Actor
from molt.actor.parallel import build_mesh
from molt.config import derived
from molt.net import LOOPBACK, free_port, node_address, rank_placement


def init_distributed(rank: int | None = None, world_size: int | None = None, port: int | None = None,
                     gpu: bool | None = None, addr: str | None = None) -> str:
    """Join the process group (arguments default to torchrun's environment); returns the device ("cpu"/"cuda:i")."""
    rank = int(os.environ["RANK"]) if rank is None else rank
    world_size = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
    os.environ["MASTER_ADDR"] = addr or os.environ.get("MASTER_ADDR", LOOPBACK)
    if port is not None:
        os.environ["MASTER_PORT"] = str(port)
    gpu = torch.cuda.is_available() if gpu is None else gpu
    device = "cpu"
    if gpu:  # one GPU per rank: LOCAL_RANK under torchrun, else the one Ray made visible (or the rank's index)
        local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    dist.init_process_group("nccl" if gpu else "gloo", rank=rank, world_size=world_size)
    return device


def rank_actor(model_dir, train, fsdp, device: str, dtype: str = "float32", objective=None, lora_cfg=None) -> Actor:
    """This rank's Actor on the (dp, ep, cp) mesh of fsdp (the process group must be initialised)."""
    mesh = build_mesh(fsdp, torch.device(device).type)
    return Actor(model_dir, train, dtype, device=device, objective=objective, fsdp=fsdp, mesh=mesh, lora_cfg=lora_cfg)


def run_actor(cfg, model_dir, device: str = "cpu", mesh: bool = False) -> Actor:
    """The actor of a run (one rank of it with mesh=True): its objective and the helper models it needs."""
    from molt.algo import helpers_needed
    from molt.algo.loss import Objective

    objective = Objective.from_config(cfg)
    actor = (rank_actor(str(model_dir), cfg.train, cfg.fsdp, device, cfg.model.dtype, objective, cfg.lora) if mesh else
             Actor(str(model_dir), cfg.train, cfg.model.dtype, device=device, objective=objective, lora_cfg=cfg.lora,
                   master=cfg.model.master))
    for name in helpers_needed(cfg):
        actor.helpers[name] = helpers.build(name, actor, cfg, model_dir)
    return actor


class Rank:
    """One rank inside a Ray actor: joins the group, builds its Actor, runs whatever method the driver names."""

    def __init__(self, rank: int, world_size: int, addr: str, port: int, gpu: bool, model_dir: str, cfg):
        device = init_distributed(rank, world_size, port, gpu, addr)
        # one rank (on a GPU) has no mesh unless it offloads: no FSDP, the fp32 masters in the optimizer (master.py)
        self.actor = run_actor(cfg, model_dir, device, mesh=world_size > 1 or cfg.fsdp.offload != "none")
        self.rank = rank

    def call(self, method: str, *args):
        out = getattr(self.actor, method)(*args)
        return out if self.rank == 0 else None  # the answers agree; only rank 0's travels back

    def slurm_task(self) -> int | None:
        return int(os.environ["SLURM_PROCID"]) if "SLURM_PROCID" in os.environ else None


class ActorGroup:
    """The loop's actor when fsdp.dp_size * ep_size * cp_size > 1: Actor's collective methods, run on every rank
    with the same arguments; rank 0's answer comes back. `save` has every rank write its own shards, in parallel
    (molt/actor/state.py); `load` restores from a checkpoint written by any layout."""

    # the Actor methods the loop and the checkpoint call on a group: each a collective over the ranks
    METHODS = {"train_step", "train_helpers", "logprobs", "score", "export_weights", "export_adapters", "save", "load",
               "apply", "kept_logprobs"}

    def __init__(self, cfg, model_dir):
        import ray

        world, gpu = derived(cfg)["world_size"], cfg.cluster.gpus_per_node > 0
        addr = node_address()  # rank 0 runs on this node (net.rank_placement) and binds the rendezvous
        port = free_port(addr)
        remote = ray.remote(num_cpus=0, num_gpus=1 if gpu else 0)(Rank)  # CPU: the ranks share the driver's cores
        self.ranks = [remote.options(**rank_placement(r, world)).remote(r, world, addr, port, gpu, str(model_dir), cfg)
                      for r in range(world)]
        tasks = ray.get([r.slurm_task.remote() for r in self.ranks])
        if any(tasks):
            print(f"molt: actor ranks on Slurm tasks {tasks}", flush=True)
        self.layout = (cfg.fsdp.dp_size, cfg.fsdp.ep_size, cfg.fsdp.cp_size)

    def __getattr__(self, method: str):
        if method not in self.METHODS:
            raise AttributeError(f"{type(self).__name__} has no attribute {method!r}")
        import ray

        return lambda *args: ray.get([r.call.remote(method, *args) for r in self.ranks])[0]
