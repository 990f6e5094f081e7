"""Where a run's processes are reached: loopback, free ports, this node's address, and Ray placement on a Slurm task.

A leaf: it imports nothing from molt, so every layer (actor, engines, cluster, loop) may use it.
"""
from __future__ import annotations

import os
import socket

LOOPBACK = "127.0.0.1"  # engines, the chat server and torch.distributed bind here on one node


def free_port(host: str = LOOPBACK) -> int:
    """A port free on `host` now; call it on the node that will bind it."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def node_address() -> str:
    """Where this node's processes are reached from other nodes: its cluster address in a multi-task Slurm job
    (set by `cluster.allocation`), loopback otherwise."""
    return os.environ.get("MOLT_NODE_ADDR", LOOPBACK)


def on_task(task: int) -> dict:
    """Ray options that put an actor on Slurm task `task` (its Ray node carries the resource molt_task_<task>,
    cluster.allocation); {} on one node. Task 0 runs the loop, which reaches the engines on loopback."""
    import ray

    key = f"molt_task_{task}"
    return {"resources": {key: 0.001}} if key in ray.cluster_resources() else {}


def rank_placement(rank: int, world: int) -> dict:
    """Ray options that put actor rank `rank` on its Slurm task, ranks packed by task (rank 0 with the loop);
    {} on one node."""
    import ray

    tasks = sum(k.startswith("molt_task_") for k in ray.cluster_resources())
    return on_task(rank // -(-world // tasks)) if tasks else {}
