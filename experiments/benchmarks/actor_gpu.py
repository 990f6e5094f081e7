"""GPU figures of the actor: training tokens/s, MFU and peak memory on one GPU, against plain transformers.

Trains, through the actor's own code path (Actor.train_step -> token_logprobs -> head_logprobs -> Objective ->
AdamW), a Qwen3-1.7B-shaped dense model and a Qwen3-30B-A3B-shaped MoE cut to 6 layers (random weights) on
4 rows x 4096 packed tokens, and the reference in the same process on the same card: plain transformers
(forward with labels, unpacked causal rows, AdamW). Needs CUDA, torch and transformers only:

    PYTHONPATH=. python3 experiments/benchmarks/actor_gpu.py [--parts dense,moe] [--smoke] [--numerics]
        [--only "name,name"] [--repeat] [--steps N] [--profile "name"] [--deadline SECONDS]

Compare variants within one run (machines differ by a few %); the first variant timed in a process can run slow,
so --repeat runs the chosen ones twice in turn. docs/gpu.md has the figures and the commands that made them.

MFU = model FLOPs / step time / 989e12 (H100/H200 dense bf16 peak). Model FLOPs per step, not counting recompute:
  6 * (matmul parameters a token uses: attention q,k,v,o + MLP (MoE: top_k experts + router) per layer + lm_head)
    * tokens
  + 12 * layers * (q heads * head_dim) * sum over attended segments of n(n+1)/2
    (QK^T and PV, 2 FLOPs per multiply-add, x3 for forward + backward; causal within each packed segment,
    so a plain 4096-token causal row counts 4096*4097/2 pairs). Embedding lookups and norms are not counted.
Peak memory is torch.cuda.max_memory_allocated over the variant (parameters, optimizer state, activations).
Logs and profiler tables go to $OUT (or a temp dir).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import inspect
import math
import os
import random
import socket
import sys
import tempfile
import threading
import time
import traceback
import types
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

from molt.actor import actor as actor_mod
from molt.actor import parallel
from molt.actor.actor import Actor, token_logprobs
from molt.actor.pack import pack, to_device
from molt.config import FsdpConfig, LoraConfig, TrainConfig
from molt.types import Segment

PEAK_TFLOPS = 989.0  # dense bf16, H100/H200 SXM datasheet
OUT = Path(os.environ.get("OUT") or tempfile.mkdtemp())
LOG = open(OUT / "actor_gpu.log", "a")

SHAPES = {  # name -> (config kwargs, rows, row tokens)
    "dense": (dict(kind="dense", num_hidden_layers=28, hidden_size=2048, intermediate_size=6144,
                   num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                   tie_word_embeddings=True), 4, 4096),
    "moe": (dict(kind="moe", num_hidden_layers=6, hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                 num_experts_per_tok=8, norm_topk_prob=True, num_attention_heads=32, num_key_value_heads=4,
                 head_dim=128, vocab_size=151936, tie_word_embeddings=False), 4, 4096),
}
SMOKE = {"dense": dict(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, vocab_size=4096),
         "moe": dict(num_hidden_layers=2, hidden_size=256, moe_intermediate_size=128, num_experts=8,
                     num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                     vocab_size=4096)}
SEGMENT_SHARES = (12, 8, 6, 4, 2)  # /32 of a row: 1536, 1024, 768, 512, 256 tokens at 4096; 4 rows pack exactly


def say(*a) -> None:
    print(*a, flush=True)
    print(*a, file=LOG, flush=True)


def config(spec: dict):
    spec = dict(spec)
    kind = spec.pop("kind")
    cls = Qwen3Config if kind == "dense" else Qwen3MoeConfig
    return cls(max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6, **spec)


def build(cfg, path: Path, device: str = "cuda") -> None:
    """Random weights straight on the GPU (fast init), saved in bf16 for Actor/from_pretrained to load."""
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()


def segments(rows: int, row_tokens: int, vocab: int, seed: int = 0) -> list[Segment]:
    """Segments that pack into exactly `rows` full rows; one prompt token each (the head then covers the same
    tokens as the labels baseline), behaviour log-probs near a random model's (-log V)."""
    rng = random.Random(seed)
    segs = []
    for _ in range(rows):
        for share in SEGMENT_SHARES:
            n = row_tokens * share // 32
            s = Segment()
            s.append([rng.randrange(vocab)])
            s.append([rng.randrange(vocab) for _ in range(n - 1)], generated=True,
                     logprobs=[-math.log(vocab)] * (n - 1), version=0)
            segs.append(s)
    return segs


def model_flops(cfg, seg_lengths: list[int], head_tokens: int) -> float:
    """Model FLOPs of one training step (see the module docstring)."""
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    attn = 2 * h * q + 2 * h * kv
    if hasattr(cfg, "num_experts"):
        mlp = 3 * h * cfg.moe_intermediate_size * cfg.num_experts_per_tok + h * cfg.num_experts
    else:
        mlp = 3 * h * cfg.intermediate_size
    tokens = sum(seg_lengths)
    matmul = 6 * layers * (attn + mlp) * tokens + 6 * h * cfg.vocab_size * head_tokens
    return matmul + 12 * layers * q * sum(n * (n + 1) / 2 for n in seg_lengths)


def set_head_chunk(n: int) -> None:
    """head_logprobs' default chunk (the actor calls it without one)."""
    sig = inspect.signature(actor_mod.head_logprobs)
    actor_mod.head_logprobs.__defaults__ = tuple(n if k == "chunk" else p.default for k, p in sig.parameters.items()
                                                 if p.default is not inspect.Parameter.empty)


def time_steps(step, warmup: int, steps: int, spread: list | None = None) -> float:
    """Median seconds per step (each step synchronised); spread gets (max - min) / median."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    median = times[len(times) // 2]
    if spread is not None:
        spread.append((times[-1] - times[0]) / median)
    return median


def cleanup() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def rss() -> int:
    """Anonymous resident bytes: what the process allocated on the host (mapped safetensors pages not counted)."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024


@contextlib.contextmanager
def load_memory(into: dict):
    """GPU peak (max_memory_allocated) and host RSS growth (sampled every 5 ms) while a trainer is built: what
    loading costs, whole (from_pretrained) or sharded (molt/actor/loading.py, the actor's mesh path)."""
    cleanup()
    start, peak, done = rss(), [0], threading.Event()

    def sample():
        while not done.wait(0.005):
            peak[0] = max(peak[0], rss())
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        into.update(load_gib=torch.cuda.max_memory_allocated() / 2 ** 30,
                    host_gib=max(peak[0], rss()) / 2 ** 30 - start / 2 ** 30)
        torch.cuda.reset_peak_memory_stats()


# ---- the two trainers ------------------------------------------------------------------------------------------

def baseline(path: Path, cfg, rows: int, row_tokens: int, experts: str | None, mem: dict):
    """Plain transformers: bf16 weights, forward with labels over unpacked causal rows, AdamW (torch default)."""
    kw = {"experts_implementation": experts} if experts else {}
    with load_memory(mem):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa",
                                                     **kw).cuda()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    ids = torch.randint(cfg.vocab_size, (rows, row_tokens), device="cuda")

    def step(micro_rows=rows):
        try:
            for chunk in ids.split(micro_rows):
                (model(input_ids=chunk, labels=chunk).loss * chunk.shape[0] / rows).backward()
            opt.step()
        finally:  # also after an OOM: the retry starts from empty gradients
            opt.zero_grad(set_to_none=True)
    return step, [row_tokens] * rows, rows * row_tokens


def actor(path: Path, cfg, rows: int, row_tokens: int, variant: dict, mem: dict, mesh=None):
    """The actor's own path: Actor.train_step on packed segments. With a mesh the model is built on the meta device
    and each tensor read from the safetensors straight into its shard (molt/actor/loading.py); without one it is
    loaded whole (from_pretrained, the 1-process reference)."""
    train = TrainConfig(row_tokens=row_tokens, micro_batch_rows=variant.get("micro_rows", rows), lr=1e-6,
                        activation_checkpointing=bool(variant.get("ac")), compile=bool(variant.get("compile")))
    set_head_chunk(variant.get("chunk", actor_mod.HEAD_CHUNK))
    kw = dict(fsdp=FsdpConfig(), mesh=mesh) if mesh is not None else {}
    if variant.get("lora"):  # LoRA adapters on every linear layer of the decoder (molt/actor/lora.py)
        kw["lora_cfg"] = LoraConfig(rank=variant["lora"], target_modules=ALL_LINEAR)
    with fsdp_knobs(variant), load_memory(mem):
        act = Actor(path, train, dtype=variant.get("dtype", "bfloat16"), attn_implementation=variant["attn"],
                    device="cuda", **kw)
    if variant.get("before"):  # the clip as its own pass over the gradients (no grad_scale in the fused AdamW)
        act.clip_grads = lambda params, optimizer=None: Actor.clip_grads(act, params)
    segs = segments(rows, row_tokens, cfg.vocab_size)
    adv = [1.0 if i % 2 else -1.0 for i in range(len(segs))]
    assert pack(segs, adv, row_tokens).input_ids.shape == (rows, row_tokens)
    step = lambda: act.train_step(segs, adv)  # noqa: E731
    head_tokens = sum(s.num_generated for s in segs)
    return step, [len(s.token_ids) for s in segs], head_tokens, act


class FakeGroup:
    """For `before`: a group whose size makes parallel.sum_gradients set the divide factor, as it always did."""

    def size(self) -> int:
        return 2


class ExpertGroups:
    """For `before`: the mesh as apply_fsdp sees it, with an ep axis that makes it shard the experts as their own
    group, as it always did (flat() and device_type still reach the real mesh)."""

    def __init__(self, mesh):
        self.mesh, self.device_type = mesh, mesh.device_type

    def __getitem__(self, axes):
        return FakeGroup() if axes == "ep" else self.mesh[axes]


def root_with_hidden_states(model, decoder):
    """The root's forward as before 2026-12-04 (for `before`): hidden states through output_hidden_states=True."""
    def run(**kwargs):
        out = model(**kwargs, output_hidden_states=True, logits_to_keep=torch.zeros(0, dtype=torch.long))
        return types.SimpleNamespace(last_hidden_state=out.hidden_states[-1])
    return run


@contextlib.contextmanager
def fsdp_knobs(variant: dict):
    """Benchmark-only A/B switches of parallel.apply_fsdp, to measure a layout choice before making it the code's:
    keep_unsharded: reshard_after_forward=False (the bf16 copy made in forward is reused by backward);
    before: as before 2026-12-04: the FSDP root's forward through transformers' hidden-state capture (which breaks
    compiled graphs), a gradient divide factor of 1.0 at world size 1 (one more pass over the gradients) and the
    clip as its own pass (see actor())."""
    saved = parallel.fully_shard, parallel._decoder_through_root, parallel.sum_gradients, parallel.apply_fsdp
    if variant.get("keep_unsharded"):
        parallel.fully_shard = functools.partial(saved[0], reshard_after_forward=False)
    if variant.get("before"):
        parallel._decoder_through_root = root_with_hidden_states
        parallel.sum_gradients = lambda module, group: saved[2](module, FakeGroup())
        parallel.apply_fsdp = lambda model, mesh, *a: saved[3](model, ExpertGroups(mesh), *a)
    try:
        yield
    finally:
        parallel.fully_shard, parallel._decoder_through_root, parallel.sum_gradients, parallel.apply_fsdp = saved


def numerics(path: Path, cfg, row_tokens: int, lr: float = 1e-5, steps: int = 4) -> None:
    """Each path against the fp32 reference (fp32 weights and compute, no FSDP) and the bf16 one on one packed row:
    log-probs and loss before any update, then the log-prob change after 1 and `steps` AdamW steps (lr, clip 1.0)
    against the reference's change: what bf16 compute and bf16 weights cost in accuracy."""
    segs = segments(1, row_tokens, cfg.vocab_size, seed=2)
    adv = [1.0 if i % 2 else -1.0 for i in range(len(segs))]
    paths = {"fp32": dict(dtype="float32", master=False), "bf16": dict(dtype="bfloat16"),
             "fp32+FSDP2 bf16 compute": dict(dtype="float32", mesh=True),
             "fp32 masters in the optimizer, bf16 compute": dict(dtype="float32")}  # the 1-GPU default
    out = {}
    for name, v in paths.items():
        cleanup()
        kw = dict(fsdp=FsdpConfig(), mesh=one_mesh()) if v.get("mesh") else {}
        act = Actor(path, TrainConfig(row_tokens=row_tokens, lr=lr), dtype=v["dtype"],
                    attn_implementation="flex_attention", device="cuda", master=v.get("master"), **kw)
        before = torch.tensor(sum(act.logprobs(segs), []))
        loss, changes = act.train_step(segs, adv)["loss/policy"], []
        for i in range(1, steps + 1):
            if i > 1:
                act.train_step(segs, adv)
            if i in (1, steps):
                changes.append(torch.tensor(sum(act.logprobs(segs), [])) - before)
        out[name] = before, loss, changes
        del act
    say(f"\nnumerics, 1 x {row_tokens} tokens, AdamW lr {lr}, clip 1.0: each path against fp32 (and bf16)")
    say(f"| path | logp max abs diff | logp mean abs diff | loss diff | logp change after 1 / {steps} steps: "
        "rel. error, corr |")
    say("|---|---:|---:|---:|---:|")
    for name, (lp, loss, changes) in out.items():
        cells = []
        for ref in ("fp32", "bf16"):
            r_lp, r_loss, _ = out[ref]
            d = (lp - r_lp).abs()
            cells.append((f"{d.max():.2e}", f"{d.mean():.2e}", f"{abs(loss - r_loss):.2e}"))
        moved = []
        for dlp, ref_dlp in zip(changes, out["fp32"][2]):
            rel = float((dlp - ref_dlp).norm() / ref_dlp.norm().clamp(min=1e-30))
            moved.append(f"{rel:.3f}, {float(torch.corrcoef(torch.stack([dlp, ref_dlp]))[0, 1]):.3f}")
        say(f"| {name} | " + " | ".join(f"{a} ({b})" for a, b in zip(*cells)) + f" | {' / '.join(moved)} |")


# ---- checks and profile ----------------------------------------------------------------------------------------

def check_flex(path: Path, cfg, rows: int, row_tokens: int) -> float:
    """flex_attention and sdpa (both exact for packed rows) must give the same per-token log-probs."""
    segs = segments(rows, row_tokens, cfg.vocab_size, seed=1)
    batch = to_device(pack(segs, [0.0] * len(segs), row_tokens), "cuda")
    out = []
    for attn in ("sdpa", "flex_attention"):
        model = actor_mod.load_model(path, "bfloat16", attn, "cuda", trainable=False)
        with torch.no_grad():
            out.append(token_logprobs(model, batch).float())
        del model
        cleanup()
    return float((out[0] - out[1]).abs().max())


def kernel_class(name: str) -> str:
    n = name.lower()
    for key, words in (("gemm", ("gemm", "nvjet", "cutlass", "xmma", "wgmma", "matmul", "grouped")),
                       ("attention", ("flex", "flash", "fmha", "attention", "triton_tem")),
                       ("compiled elementwise", ("triton_",)),
                       ("copy/cast/nccl", ("nccl", "memcpy", "memset", "copy", "chunk_cat", "split_with_sizes")),
                       ("gradient norm", ("lpnorm", "norm")), ("optimizer", ("adam", "foreach", "multi_tensor"))):
        if any(w in n for w in words):
            return key
    return "other elementwise/reduce"


def profile(step, label: str) -> None:
    """One profiled step: GPU time by kernel class, and how busy the GPU was over the step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
               and "#" not in e.key and not e.key.startswith("ProfilerStep")]  # annotations span kernels
    total = sum(e.self_device_time_total for e in kernels) / 1e6
    classes: dict[str, float] = {}
    for e in kernels:
        classes[kernel_class(e.key)] = classes.get(kernel_class(e.key), 0.0) + e.self_device_time_total / 1e6
    say(f"\nprofile {label}: step {wall * 1e3:.0f} ms (under the profiler), GPU kernels {total * 1e3:.0f} ms "
        f"({100 * total / wall:.0f}% busy)")
    for k, v in sorted(classes.items(), key=lambda kv: -kv[1]):
        say(f"  {k:<26} {v * 1e3:8.1f} ms  {100 * v / total:5.1f}%")
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:12]
    for e in top:
        say(f"    {e.self_device_time_total / 1e3:8.1f} ms  x{e.count:<5} {e.key[:90]}")
    (OUT / f"profile_{label}.txt").write_text(prof.key_averages().table(sort_by="self_cuda_time_total",
                                                                        row_limit=60))


def matmul_ceiling() -> float:
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    sec = time_steps(lambda: a @ b, 3, 20)
    return 2 * 8192 ** 3 / sec / 1e12


# ---- the run -----------------------------------------------------------------------------------------------------

FP32 = dict(attn="flex_attention", dtype="float32", mesh=True)  # fp32 masters through FSDP2 (bf16 compute)
MASTER = dict(attn="flex_attention", dtype="float32")  # no mesh: fp32 masters in the optimizer (the 1-GPU default)
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VARIANTS = {  # most telling first: --deadline skips the tail. compile = train.compile (layers + head), AC =
    # train.activation_checkpointing; every other actor variant uses fused AdamW (the actor's default on CUDA)
    "dense": [
        dict(name="actor fp32 masters in optimizer +compile", compile=True, **MASTER),
        dict(name="actor LoRA r16 fp32 masters +compile", compile=True, lora=16, **MASTER),
        dict(name="actor fp32 masters in optimizer", **MASTER),
        dict(name="actor LoRA r16 fp32 masters", lora=16, **MASTER),
        dict(name="actor fp32+FSDP2 bf16 flex +compile", compile=True, **FP32),
        dict(name="fp32+FSDP2 +compile as before", compile=True, before=True, **FP32),
        dict(name="fp32+FSDP2 +compile keep-unsharded", compile=True, keep_unsharded=True, **FP32),
        dict(name="actor bf16 flex +compile", attn="flex_attention", compile=True),
        dict(name="hf baseline: labels, sdpa, unpacked", baseline=True),
        dict(name="actor bf16 flex", attn="flex_attention"),
        dict(name="actor bf16 flex +AC +compile", attn="flex_attention", ac=True, compile=True),
        dict(name="actor bf16 flex +AC", attn="flex_attention", ac=True),
    ],
    "moe": [
        dict(name="actor fp32 masters in optimizer +compile", compile=True, **MASTER),
        dict(name="actor LoRA r16 fp32 masters +compile", compile=True, lora=16, **MASTER),
        dict(name="actor fp32 masters in optimizer", **MASTER),
        dict(name="actor LoRA r16 fp32 masters", lora=16, **MASTER),
        dict(name="actor fp32 masters in optimizer +AC +compile", ac=True, compile=True, **MASTER),
        dict(name="actor fp32+FSDP2 bf16 flex +compile", compile=True, **FP32),
        dict(name="fp32+FSDP2 +compile as before", compile=True, before=True, **FP32),
        dict(name="fp32+FSDP2 +compile keep-unsharded", compile=True, keep_unsharded=True, **FP32),
        dict(name="actor bf16 flex +compile", attn="flex_attention", compile=True),
        dict(name="hf baseline: grouped_mm", baseline=True, experts="grouped_mm"),
        dict(name="actor bf16 flex", attn="flex_attention"),
        dict(name="actor fp32+FSDP2 bf16 flex +AC +compile", ac=True, compile=True, **FP32),
        dict(name="actor bf16 flex +AC +compile", attn="flex_attention", ac=True, compile=True),
    ],
}
PROFILE = {"actor fp32 masters in optimizer +compile"}  # profiled after timing
STEPS = [5]  # timed steps per variant (--steps)


def one_mesh():
    """A world-size-1 NCCL group and the actor's (1, 1, 1) mesh: the FSDP2 mixed-precision path on one GPU."""
    import torch.distributed as dist

    from molt.actor.parallel import build_mesh

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return build_mesh(FsdpConfig(), "cuda")


def run_variant(part: str, v: dict, path: Path, cfg, rows: int, row_tokens: int) -> dict:
    cleanup()
    t0 = time.perf_counter()
    steps, warmup = v.get("steps", STEPS[0]), v.get("warmup", 2)
    act, mem, spread = None, {}, []
    try:
        if v.get("baseline"):
            step, lengths, head_tokens = baseline(path, cfg, rows, row_tokens, v.get("experts"), mem)
            sec = None
            try:
                sec = time_steps(step, warmup, steps, spread)
            except torch.OutOfMemoryError:
                pass
            if sec is None:  # the reference did not fit (retry outside the handler: its frames hold memory)
                cleanup()
                v["name"] += " (2 micro-batches)"
                sec = time_steps(lambda: step(rows // 2), warmup, steps, spread)
        else:
            step, lengths, head_tokens, act = actor(path, cfg, rows, row_tokens, v, mem,
                                                    mesh=one_mesh() if v.get("mesh") else None)
            torch._dynamo.utils.counters.clear()
            sec = time_steps(step, warmup, steps, spread)
            breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
            if v.get("compile"):
                say(f"  {v['name']}: {breaks} graph breaks {dict(torch._dynamo.utils.counters['graph_break'])}"[:400])
            if v["name"] in PROFILE:
                profile(step, part + "_" + "".join(c if c.isalnum() else "_" for c in v["name"]))
    except Exception as e:  # one variant's failure (OOM, a compile error) is a result, not the end of the run
        traceback.print_exc(file=LOG)
        return dict(name=v["name"], error=f"{type(e).__name__}: {str(e).splitlines()[0][:100]}")
    finally:
        if v.get("compile"):
            torch._dynamo.reset()
    flops = model_flops(cfg, lengths, head_tokens)
    out = dict(name=v["name"], tok_s=sum(lengths) / sec, mfu=flops / sec / (PEAK_TFLOPS * 1e12),
               tflops=flops / sec / 1e12, step_ms=sec * 1e3, spread=spread[0],
               peak_gib=max(torch.cuda.max_memory_allocated() / 2 ** 30, mem["load_gib"]),
               load_gib=mem["load_gib"], host_gib=mem["host_gib"], wall_s=time.perf_counter() - t0)
    del act
    say(f"  {out['name']:<38} {out['tok_s']:>9.0f} tok/s  MFU {100 * out['mfu']:5.1f}%  "
        f"peak {out['peak_gib']:6.1f} GiB  ({out['wall_s']:.0f} s)")
    return out


def table(part: str, results: list[dict], flops_note: str) -> None:
    say(f"\n{part}: {flops_note}; spread = (slowest - fastest) / median step; load = GPU peak / host RSS growth "
        "while the trainer is built")
    say(f"| {'variant':<40} | tokens/s | step ms | spread | TFLOP/s | MFU | peak GiB | load GiB | host GiB |")
    say(f"|{'-' * 42}|---------:|--------:|-------:|--------:|----:|---------:|---------:|---------:|")
    for r in results:
        if "error" in r:
            say(f"| {r['name']:<40} | {r['error']} |")
        else:
            say(f"| {r['name']:<40} | {r['tok_s']:8.0f} | {r['step_ms']:7.0f} | {100 * r['spread']:5.1f}% | "
                f"{r['tflops']:7.0f} | {100 * r['mfu']:.1f}% | {r['peak_gib']:8.1f} | {r['load_gib']:8.1f} | "
                f"{r['host_gib']:8.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="dense,moe")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes: every path once, in about a minute")
    ap.add_argument("--only", default="", help="comma-separated variant names to run (default: all)")
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds per part: start no variant after")
    ap.add_argument("--profile", default="", help="comma-separated variant names to profile (default: "
                    + ", ".join(sorted(PROFILE)) + ")")
    ap.add_argument("--numerics", action="store_true", help="first compare the paths' log-probs and update (dense)")
    ap.add_argument("--steps", type=int, default=STEPS[0], help="timed steps per variant (after 2 warm-up steps)")
    ap.add_argument("--repeat", action="store_true", help="run the selected variants twice, in turn (A B A B)")
    args = ap.parse_args()
    STEPS[0] = args.steps
    if args.profile:
        PROFILE.clear()
        PROFILE.update(args.profile.split(","))
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    props = torch.cuda.get_device_properties(0)
    say(f"{props.name}, {props.total_memory / 2 ** 30:.0f} GiB, torch {torch.__version__}, "
        f"transformers {__import__('transformers').__version__}, python {sys.version.split()[0]}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}")
    say(f"bf16 8192^3 matmul: {matmul_ceiling():.0f} TFLOP/s (MFU is against {PEAK_TFLOPS:.0f})")
    store = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    for part in args.parts.split(","):
        spec, rows, row_tokens = SHAPES[part]
        spec = spec | (SMOKE[part] if args.smoke else {})
        rows, row_tokens = (2, 512) if args.smoke else (rows, row_tokens)
        cfg, start = config(spec), time.perf_counter()
        path = Path(tempfile.mkdtemp(dir=store)) / part
        build(cfg, path)
        say(f"\n{part}: {rows} x {row_tokens} tokens, config {spec}")
        if args.numerics and part == "dense":
            try:
                numerics(path, cfg, row_tokens)
            except Exception:  # the timings still run
                say(f"numerics failed: {traceback.format_exc()[-600:]}")
        only = set(filter(None, args.only.split(",")))
        if not only:
            say(f"flex vs sdpa log-prob max |diff| on packed rows: {check_flex(path, cfg, rows, row_tokens):.4f}")
        late = lambda: time.perf_counter() - start > args.deadline  # noqa: E731
        chosen = [v for v in VARIANTS[part] if not only or v["name"] in only] * (2 if args.repeat else 1)
        results = [dict(name=v["name"], error="skipped (--deadline)") if late()
                   else run_variant(part, dict(v), path, cfg, rows, row_tokens) for v in chosen]
        table(part, results, "MFU = model FLOPs (module docstring) / step time / 989 TFLOP/s")


if __name__ == "__main__":
    main()
