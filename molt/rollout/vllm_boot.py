"""An engine's API server whose engine core is forked from a process that imports vLLM meanwhile.

vLLM starts its engine core as a spawned process (the CPU build forces spawn), which imports vLLM again only after the
API server has imported it: two imports of about 19 s in a row at every start on a 2-core AVX2 machine. Run as the
server's `python -c` (molt/rollout/engine.py, CPU build), `main` first starts multiprocessing's forkserver, which
imports the engine core's modules (PRELOAD) while the server imports its own, then runs vLLM's API server with its
"spawn" context answered by one that forks the core from that forkserver: a tiny engine is healthy after 25-26 s
instead of 43-44 s on idle cores, for the same CPU. The forkserver only imports (it runs nothing on OpenMP, holds no
socket or thread), so forking it is safe where forking the server is not; the core gets the server's environment as
it was at start(), as a spawned one would. The forkserver lives as long as the server: the core's exit is reported
through it. Stdlib only here: the forkserver must start before anything heavy is imported.
"""
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import runpy

PRELOAD = ["vllm.v1.engine.core", "vllm.v1.executor.uniproc_executor", "vllm.v1.worker.cpu_worker",
           "molt.rollout.vllm_ext"]


class Process(multiprocessing.context.ForkServerProcess):
    """Forked from the forkserver, run in the environment its parent had at start()."""

    def start(self):
        self.environ = dict(os.environ)
        super().start()

    def run(self):
        os.environ.clear()
        os.environ.update(self.environ)
        super().run()


class Context(multiprocessing.context.ForkServerContext):
    Process = Process


def main(server: str) -> None:
    multiprocessing.set_forkserver_preload(PRELOAD)
    multiprocessing.forkserver.ensure_running()
    context, get_context = Context(), multiprocessing.get_context
    multiprocessing.get_context = lambda method=None: context if method == "spawn" else get_context(method)
    runpy.run_module(server, run_name="__main__", alter_sys=True)
