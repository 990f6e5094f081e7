"""A test's gloo ranks: torch.multiprocessing.spawn's processes, forked from multiprocessing's forkserver.

A spawned rank imports torch, transformers and Molt's actor again (5-10 s of a 2-core machine, per rank, per test);
forked from the server, which imported them once for the test process, it starts at once. The server only imports:
it never runs torch's OpenMP thread pool, so forking it is safe where forking the test process is not. A rank sees the
environment the server started with (the test process's at its first spawn): pass what a rank needs as arguments.
"""
import multiprocessing

import torch.multiprocessing as mp

multiprocessing.set_forkserver_preload(["torch", "transformers", "molt.actor.actor", "molt.actor.group",
                                        "molt.actor.parallel", "molt.assets", "molt.config", "pytest"])


def spawn(fn, args: tuple, nprocs: int) -> None:
    """torch.multiprocessing.spawn(fn, args, nprocs), its processes forked from the preloaded server."""
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")
