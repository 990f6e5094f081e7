"""Parallel layouts of the actor on several GPUs: each reproduces the 1-GPU loss and gradients, at what tokens/s and
MFU; and the weight broadcast from actor rank 0, in packed buckets, against a plain broadcast of the same bytes.

Two launches (torch + transformers only; NCCL on GPUs, gloo on CPU). The first writes the 1-rank reference (loss and
every gradient of one step on the whole batch), the second runs every layout on the same batch and compares:

    export NCCL_NVLS_ENABLE=0                                   # leave NVLink multicast off
    torchrun --nproc-per-node 1 experiments/benchmarks/actor_layouts.py --model dense --reference /dev/shm/ref.pt
    torchrun --nproc-per-node 8 experiments/benchmarks/actor_layouts.py --model dense --reference /dev/shm/ref.pt \
        --layouts dp8,ep1xdp4xcp2,cp8 --broadcast
    # --model moe for the Qwen3-30B-A3B shape (6 layers), with layouts such as ep8,dp2xep4,ep4xcp2
    # --smoke: tiny shapes, every path in about a minute (CPU: add --cpu; gloo ranks)

The batch is `--shards` x 4 rows of 4096 tokens (the layout's data shards split its rows; the 1-rank reference runs
them as gradient accumulation), packed by the actor from the segments of actor_gpu.py. Weights are fp32 masters
with bf16 compute on GPU (the loop's GPU path: FSDP2 MixedPrecisionPolicy), so "reproduces" means within bf16
tolerance: relative L2 error of the loss and of each parameter's gradient. MFU is per GPU against 989 TFLOP/s,
with actor_gpu.py's model-FLOPs formula.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from experiments.benchmarks.actor_gpu import PEAK_TFLOPS, SHAPES, SMOKE, build, config, model_flops, segments  # noqa: E402
from molt.actor.group import init_distributed, rank_actor  # noqa: E402
from molt.actor.parallel import full_tensors  # noqa: E402
from molt.config import FsdpConfig, TrainConfig  # noqa: E402

ROWS_PER_SHARD = 4


def say(*a) -> None:
    if dist.get_rank() == 0:
        print(*a, flush=True)


def parse_layout(text: str) -> FsdpConfig:
    """'dp2xep4' -> FsdpConfig(dp_size=2, ep_size=4); missing axes are 1."""
    sizes = {"dp": 1, "ep": 1, "cp": 1}
    for part in text.split("x"):
        axis, n = part[:2], int(part[2:])
        assert axis in sizes, f"layout {text!r}: axes are dp, ep, cp"
        sizes[axis] = n
    return FsdpConfig(dp_size=sizes["dp"], ep_size=sizes["ep"], cp_size=sizes["cp"])


def model_dir(args, cfg) -> Path:
    """Rank 0 builds the random-weight model once (bf16 safetensors); every rank loads it."""
    path = Path(args.workdir) / f"{args.model}{'_smoke' if args.smoke else ''}"
    if dist.get_rank() == 0 and not (path / "config.json").exists():
        build(cfg, path, device="cpu" if args.cpu else "cuda")
    dist.barrier()
    return path


def step_once(actor, segs, adv) -> dict:
    metrics = actor.train_step(segs, adv)
    return {"loss": metrics["loss/policy"], "grads": {k: v.to(torch.bfloat16) for k, v in
                                                      full_tensors(actor.model, grads=True).items()}}


def compare(got: dict, ref: dict) -> tuple[float, float, str]:
    """(relative loss error, worst relative gradient L2 error, its parameter)."""
    loss_err = abs(got["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-12)
    worst, name = 0.0, ""
    for k, g in ref["grads"].items():
        g, h = g.float(), got["grads"][k].float()
        err = float((h - g).norm() / g.norm().clamp_min(1e-12))
        if err > worst:
            worst, name = err, k
    return loss_err, worst, name


def run_layout(args, path, cfg, fsdp: FsdpConfig, device: str, ref: dict | None) -> None:
    rows, tokens = args.shards * ROWS_PER_SHARD, args.row_tokens
    train = TrainConfig(row_tokens=tokens, micro_batch_rows=ROWS_PER_SHARD, lr=1e-6, grad_clip=0.0,
                        compile=args.compile and not args.cpu)
    actor = rank_actor(path, train, fsdp, device, dtype="float32")
    segs = segments(rows, tokens, cfg.vocab_size)
    adv = [1.0 if i % 2 else -1.0 for i in range(len(segs))]
    got = step_once(actor, segs, adv)  # first step: compiles; its gradient is the one compared
    if dist.get_world_size() == 1:  # the 1-rank run: write the reference
        if dist.get_rank() == 0:
            torch.save(got, args.reference)
        say(f"reference written: loss {got['loss']:.6f}, {len(got['grads'])} gradients -> {args.reference}")
        return
    loss_err, grad_err, worst = compare(got, ref) if dist.get_rank() == 0 else (0.0, 0.0, "")
    sync = torch.cuda.synchronize if not args.cpu else (lambda: None)
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        actor.train_step(segs, adv)
    sync()
    sec = (time.perf_counter() - t0) / args.steps
    world = dist.get_world_size()
    flops = model_flops(cfg, [len(s.token_ids) for s in segs], sum(s.num_generated for s in segs))
    layout = f"dp{fsdp.dp_size} x ep{fsdp.ep_size} x cp{fsdp.cp_size}"
    say(f"| {layout:<22} | {rows * tokens / sec:10.0f} | {sec * 1e3:8.0f} | {100 * flops / sec / (PEAK_TFLOPS * 1e12 * world):5.1f}% "
        f"| {loss_err:.1e} | {grad_err:.1e} ({worst}) |")
    del actor


def broadcast_bench(path: Path, bucket_mb: int, device: str, repeats: int = 3) -> None:
    """Rank 0's full bf16 state dict to rank 1: packed buckets (flatten up to bucket_mb, one broadcast each, unpack)
    against one broadcast of a buffer of the same bytes. Both ranks allocate their tensors before timing."""
    from transformers import AutoModelForCausalLM

    group = dist.new_group([0, 1])
    rank = dist.get_rank()
    if rank > 1:
        return
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    tensors = [t.detach().to(device).contiguous() for t in model.state_dict().values()]
    if rank == 1:
        tensors = [torch.empty_like(t) for t in tensors]  # receive buffers
    total = sum(t.numel() * t.element_size() for t in tensors)
    limit = bucket_mb * 2**20

    def buckets() -> list[list[torch.Tensor]]:
        """Consecutive tensors grouped up to `limit` bytes (one dtype: the model is loaded in bf16)."""
        out, cur, size = [], [], 0
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            if cur and size + nbytes > limit:
                out, cur, size = out + [cur], [], 0
            cur, size = cur + [t], size + nbytes
        return out + [cur]

    def flush(bucket):
        flat = torch.cat([b.reshape(-1) for b in bucket]) if rank == 0 else \
            torch.empty(sum(b.numel() for b in bucket), dtype=bucket[0].dtype, device=device)
        dist.broadcast(flat, src=0, group=group)
        if rank == 1:
            for b, part in zip(bucket, flat.split([b.numel() for b in bucket])):
                b.copy_(part.view_as(b))

    plan = buckets()
    assert all(t.dtype == torch.bfloat16 for t in tensors)

    def packed():
        for bucket in plan:
            flush(bucket)

    plain_buf = torch.empty(total // 2, dtype=torch.bfloat16, device=device)
    results = {}
    for name, fn in (("plain broadcast, one buffer", lambda: dist.broadcast(plain_buf, src=0, group=group)),
                     (f"packed buckets of {bucket_mb} MiB + unpack", packed)):
        fn()  # warm-up (NCCL connection, allocator)
        dist.barrier(group)
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        if device != "cpu":
            torch.cuda.synchronize()
        dist.barrier(group)
        results[name] = total * repeats / (time.perf_counter() - t0) / 1e9
    sums = torch.stack([t.double().sum() for t in tensors])  # the packed path must deliver every tensor intact
    ref = sums.clone()
    dist.broadcast(ref, src=0, group=group)
    assert torch.equal(sums, ref), "the receiver's tensors differ from the sender's"
    if rank == 0:
        plain = results["plain broadcast, one buffer"]
        print(f"\nweight broadcast rank 0 -> rank 1, {total / 2**30:.2f} GiB bf16, {len(tensors)} tensors "
              f"(received intact)")
        for name, gbs in results.items():
            print(f"| {name:<34} | {gbs:7.1f} GB/s | {100 * gbs / plain:5.1f}% of plain |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(SHAPES), default="dense")
    ap.add_argument("--reference", required=True, help="1 rank: write it here; more ranks: compare with it")
    ap.add_argument("--layouts", default="", help="e.g. dp8,ep4xdp2,cp2xdp4 (each must use all ranks)")
    ap.add_argument("--shards", type=int, default=8, help="data shards of the batch (4 rows of row_tokens each)")
    ap.add_argument("--row-tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--broadcast", action="store_true")
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes")
    ap.add_argument("--cpu", action="store_true", help="gloo ranks on the CPU (with --smoke)")
    ap.add_argument("--workdir", default="/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir())
    args = ap.parse_args()
    device = init_distributed(gpu=not args.cpu)
    spec, _, _ = SHAPES[args.model]
    cfg = config(spec | (SMOKE[args.model] if args.smoke else {}))
    if args.smoke:
        args.row_tokens = 64
    path = model_dir(args, cfg)
    world = dist.get_world_size()
    if world == 1:
        run_layout(args, path, cfg, FsdpConfig(), device, None)
    else:
        ref = torch.load(args.reference, weights_only=False) if dist.get_rank() == 0 else None  # compared on rank 0
        say(f"{args.model}: {args.shards * ROWS_PER_SHARD} x {args.row_tokens} tokens per step, {world} ranks "
            f"({torch.cuda.get_device_name(0) if not args.cpu else 'cpu'}), {time.strftime('%Y-%m-%d')}")
        say("| layout | tokens/s | step ms | MFU/GPU | loss rel err | worst grad rel err |")
        say("|---|---:|---:|---:|---:|---|")
        for text in filter(None, args.layouts.split(",")):
            run_layout(args, path, cfg, parse_layout(text), device, ref)
    if args.broadcast and world > 1:
        broadcast_bench(path, args.bucket_mb, device)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
