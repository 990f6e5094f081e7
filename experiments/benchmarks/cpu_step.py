"""CPU throughput of a GRPO step on SmolLM2-135M-Instruct (issue 16's workload), end to end and actor only.

Workload: 8 prompts "Write a short sentence about the number N." x 8 samples = 64 completions per step, up to
128 new tokens, temperature 1, reward 1 if the reply contains N.

    python experiments/benchmarks/cpu_step.py actor [--reps 3] [--attn molt_varlen,sdpa]   # actor-only vs plain torch
    python experiments/benchmarks/cpu_step.py suspects [--reps 2]                          # one change at a time
    python experiments/benchmarks/cpu_step.py e2e [--steps 6] [--precision fp32,bf16] [--peer] [overrides...]  # the loop

`actor`: the same 64 rollouts (real prompt ids from the chat template, generated lengths drawn to match the e2e
run's mean of ~41 tokens with a tail to 128) trained by Actor.train_step (packed rows; with molt_varlen once with
each group's prompt packed once, train.share_prefix, and once per sample) and by a plain-torch
reference step (HF forward over the rows padded to the longest, log-softmax gather, backward, AdamW), interleaved
in one process so that a shared machine's load hits both alike; tokens/s counts real (unpadded) tokens for both.
`e2e`: `python -m molt model=smollm2_135m` on this task; prints per-step generate/train/sync/other and tokens/s
from the run's MLflow record (steps after the first), once per --precision, then their medians and mismatch side by
side. The load average is printed beside every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
PROMPT = "Write a short sentence about the number {n}."
KEYS = ["time/step", "time/generate", "time/train", "time/sync", "time/other", "rollout/gen_tokens"]
MISMATCH = ["mismatch/logprob_abs_mean", "mismatch/logprob_abs_max", "sync/probe_abs_max"]


def make_env(sample: dict):  # agent.module contract (molt/agents/env.py): one turn, reward 1 if N is in the reply
    class Env:
        def step(self, action: str):
            return [], float(str(sample["n"]) in action), True
    return Env()


def load() -> str:
    return f"{os.getloadavg()[0]:.2f}"


def rollouts(model_dir: Path, seed: int = 0):
    """64 segments: the chat-template prompt ids, then generated ids with lengths of mean ~41, max 128."""
    from transformers import AutoTokenizer

    from molt.types import Segment
    tok, rng = AutoTokenizer.from_pretrained(str(model_dir)), random.Random(seed)
    segs = []
    for n in rng.sample(range(1000), 8):
        prompt = list(tok.apply_chat_template([{"role": "user", "content": PROMPT.format(n=n)}],
                                              add_generation_prompt=True, return_dict=True)["input_ids"])
        for _ in range(8):
            g = min(128, 4 + int(rng.expovariate(1 / 37)))
            ids = prompt + [rng.randrange(tok.vocab_size) for _ in range(g)]
            segs.append(Segment(token_ids=ids, loss_mask=[0] * len(prompt) + [1] * g,
                                logprobs=[0.0] * len(prompt) + [-2.0] * g, versions=[-1] * len(prompt) + [0] * g))
    return segs, [float(i % 2) - 0.5 for i in range(len(segs))]


def plain_step(model, opt, segs, adv, rows_per_mb: int = 8) -> None:
    """The plain-torch reference: right-padded rows, 2-D attention mask, full logits, log-softmax gather, AdamW."""
    width, order = max(len(s.token_ids) for s in segs), list(range(len(segs)))
    ntok = sum(sum(s.loss_mask) for s in segs)
    opt.zero_grad(set_to_none=True)
    for a in range(0, len(order), rows_per_mb):
        mb = order[a:a + rows_per_mb]
        ids = torch.zeros(len(mb), width, dtype=torch.long)
        att, mask, A = (torch.zeros(len(mb), width) for _ in range(3))
        for r, i in enumerate(mb):
            n = len(segs[i].token_ids)
            ids[r, :n], att[r, :n] = torch.tensor(segs[i].token_ids), 1
            mask[r, :n], A[r, :n] = torch.tensor(segs[i].loss_mask, dtype=torch.float), adv[i]
        logits = model(input_ids=ids, attention_mask=att, use_cache=False).logits[:, :-1].float()  # (B, T-1, V)
        logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T-1)
        (-(logp * A[:, 1:] * mask[:, 1:]).sum() / ntok).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


def actor_only(args) -> None:
    from transformers import AutoModelForCausalLM

    from molt.actor.actor import Actor
    from molt.assets import ensure_model
    from molt.config import TrainConfig
    model_dir = ensure_model(REPO / "assets" / "smollm2_135m", "smollm2_135m")
    if args.threads:
        torch.set_num_threads(args.threads)
    segs, adv = rollouts(model_dir)
    real = sum(len(s.token_ids) for s in segs)
    padded = len(segs) * max(len(s.token_ids) for s in segs)
    print(f"64 rollouts: {real} tokens ({sum(sum(s.loss_mask) for s in segs)} generated), padded {padded}; "
          f"torch threads {torch.get_num_threads()}")
    # molt_varlen twice: with each group's prompt packed once (train.share_prefix, the default) and per sample
    shares = lambda a: (True, False) if a == "molt_varlen" else (False,)  # noqa: E731
    variants = [(a, share) for a in args.attn.split(",") for share in shares(a)]
    actors = {a + (", prompts shared" if share else ""): Actor(model_dir, TrainConfig(lr=1e-6, share_prefix=share),
                                                              attn_implementation=a) for a, share in variants}
    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa")
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-6)
    steps = {f"molt actor ({a})": (lambda act=act: act.train_step(segs, adv)) for a, act in actors.items()}
    steps = dict(list(steps.items())[:1]) | {"plain torch": lambda: plain_step(ref, opt, segs, adv)} | steps
    times: dict[str, list[float]] = {k: [] for k in steps}
    for rep in range(args.reps):
        for name, fn in steps.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
            print(f"  rep {rep} {name}: {times[name][-1]:.1f} s (load {load()})", flush=True)
    base = statistics.median(times["plain torch"])
    print("\n| step | median s | real tokens/s | vs plain torch | load |\n|---|---|---|---|---|")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"| {name} | {m:.1f} | {real / m:.0f} | {base / m:.2f}x | {load()} |")


def suspects(args) -> None:
    """Issue 16's CPU suspects, each one change to the actor's default step on the same 64 rollouts, interleaved:
    the head without its per-chunk recompute, bf16 autocast over fp32 weights, bf16 weights, one torch thread; then
    one default step under torch.profiler: the share of CPU time in allocation and copy ops (allocator churn)."""
    import contextlib

    from molt.actor import actor as actor_mod
    from molt.actor.actor import Actor
    from molt.assets import ensure_model
    from molt.config import TrainConfig
    model_dir = ensure_model(REPO / "assets" / "smollm2_135m", "smollm2_135m")
    segs, adv = rollouts(model_dir)
    real, threads = sum(len(s.token_ids) for s in segs), torch.get_num_threads()
    fp32, bf16 = (Actor(model_dir, TrainConfig(lr=1e-6), dtype=d) for d in ("float32", "bfloat16"))

    @contextlib.contextmanager
    def patched(obj, name, value):
        saved = getattr(obj, name)
        setattr(obj, name, value)
        try:
            yield
        finally:
            setattr(obj, name, saved)

    @contextlib.contextmanager
    def patched_threads(n):
        torch.set_num_threads(n)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    variants = {
        "default (fp32, molt_varlen, head chunks recomputed)": (fp32, contextlib.nullcontext),
        "head chunks kept, not recomputed": (fp32, lambda: patched(actor_mod, "checkpoint",
                                                                   lambda fn, *a, use_reentrant: fn(*a))),
        "bf16 autocast, fp32 weights": (fp32, lambda: torch.autocast("cpu", dtype=torch.bfloat16)),
        "bf16 weights (model.dtype=bfloat16)": (bf16, contextlib.nullcontext),
        f"1 torch thread (default {threads})": (fp32, lambda: patched_threads(1)),
    }

    times: dict[str, list[float]] = {k: [] for k in variants}
    for rep in range(args.reps):
        for name, (act, ctx) in variants.items():
            t = time.perf_counter()
            with ctx():
                act.train_step(segs, adv)
            times[name].append(time.perf_counter() - t)
            print(f"  rep {rep} {name}: {times[name][-1]:.1f} s (load {load()})", flush=True)
    base = statistics.median(times[next(iter(variants))])
    print("\n| actor step | median s | real tokens/s | vs default | load |\n|---|---|---|---|---|")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"| {name} | {m:.1f} | {real / m:.0f} | {base / m:.2f}x | {load()} |")
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fp32.train_step(segs, adv)
    ops = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    total = sum(e.self_cpu_time_total for e in ops)
    churn = [e for e in ops if any(w in e.key for w in ("empty", "zeros", "zero_", "clone", "copy_", "to_copy",
                                                        "resize_", "contiguous", "cat", "fill_"))]
    print(f"\nprofile of one default step: aten self CPU {total / 1e6:.1f} s; allocation/copy ops "
          f"{sum(e.self_cpu_time_total for e in churn) / 1e6:.2f} s ({100 * sum(e.self_cpu_time_total for e in churn) / total:.1f}%)")
    for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:12]:
        print(f"  {e.self_cpu_time_total / 1e6:7.2f} s  x{e.count:<6} {e.key}")


def task_rows() -> list[dict]:
    return [{"messages": [{"role": "user", "content": PROMPT.format(n=n)}], "n": n}
            for n in random.Random(0).sample(range(1000), 200)]


def e2e_run(args, extra: list[str]) -> dict[str, list[float]]:
    """One `python -m molt model=smollm2_135m` run on this task; its per-step MLflow record."""
    import mlflow
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "train.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in task_rows()))
        cmd = [sys.executable, "-m", "molt", "model=smollm2_135m", "agent.module=experiments.benchmarks.cpu_step",
               f"task.train_path={data}", f"task.eval_path={data}", f"train.steps={args.steps}", "eval.every=0",
               "train.groups_per_step=8", "rollout.n=8", "rollout.temperature=1.0", "agent.max_tokens_per_turn=128",
               "train.lr=1e-6", "engine.max_model_len=1024", "rollout.max_inflight_groups=8",
               f"hydra.run.dir={tmp}/run", f"checkpoint_dir={tmp}/ckpt", *extra]
        subprocess.run(cmd, check=True, cwd=REPO)
        client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{Path(tmp) / 'run' / 'mlflow.db'}")
        run = client.search_runs([e.experiment_id for e in client.search_experiments()])[0]
        return {k: [m.value for m in sorted(client.get_metric_history(run.info.run_id, k), key=lambda m: m.step)]
                for k in KEYS + MISMATCH}


def peer_run(steps: int, model_dir: Path | None = None, rows: list[dict] | None = None, reward=None,
             max_new: int = 128, lr: float = 1e-6) -> list[float]:
    """The peer: TRL's GRPOTrainer on the same model, prompts and settings (8 prompts x 8 samples, up to `max_new`
    new tokens, temperature 1, lr `lr`, no KL, clip 1, fp32 on the CPU, HF generate); the wall time of each step.
    Defaults: this workload (SmolLM2-135M); step_cost.py passes the quickstart's model, rows and reward."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from molt.assets import ensure_model

    class Clock(TrainerCallback):
        def __init__(self):
            self.times, self.t0 = [], 0.0

        def on_step_begin(self, *a, **kw):
            self.t0 = time.time()

        def on_step_end(self, *a, **kw):
            self.times.append(time.time() - self.t0)

    def counted(completions, n, **kw):
        return [float(str(x) in c[-1]["content"]) for c, x in zip(completions, n)]

    rows = rows or [{"prompt": r["messages"], "n": r["n"]} for r in task_rows()]
    clock = Clock()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = GRPOConfig(output_dir=tmp, per_device_train_batch_size=64, num_generations=8, max_completion_length=max_new,
                         temperature=1.0, learning_rate=lr, beta=0.0, max_grad_norm=1.0, weight_decay=0.0,
                         lr_scheduler_type="constant", max_steps=steps, logging_steps=1, use_cpu=True, bf16=False,
                         report_to=[], save_strategy="no", seed=0, remove_unused_columns=False)
        model = str(model_dir or ensure_model(REPO / "assets/smollm2_135m", "smollm2_135m"))
        GRPOTrainer(model=model, reward_funcs=reward or counted, args=cfg, train_dataset=Dataset.from_list(rows),
                    callbacks=[clock]).train()
    return clock.times


def e2e(args, extra: list[str]) -> None:
    """The whole loop once per --precision (fp32: the default; bf16: precision=bf16), one after the other; with
    --peer, then TRL's GRPOTrainer on the same workload."""
    summary = []
    for precision in args.precision.split(","):
        hist = e2e_run(args, extra + ([f"precision={precision}"] if precision != "fp32" else []))
        print(f"\n{precision}:\n| step | " + " | ".join(KEYS) + " | gen tokens/s | load |\n"
              + "|---" * (len(KEYS) + 3) + "|")
        for i in range(1, len(hist["time/step"])):
            row = [hist[k][i] for k in KEYS]
            print(f"| {i + 1} | " + " | ".join(f"{v:.1f}" for v in row) + f" | {row[-1] / row[0]:.1f} | {load()} |")
        summary.append((precision, statistics.median(hist["time/step"][1:]),
                        *(statistics.mean(hist[k][1:]) for k in MISMATCH)))
    print("\n| precision | median s/step (steps 2+) | vs first | mismatch mean | mismatch max | sync probe max |\n"
          "|---|---|---|---|---|---|")  # the mismatch and probe figures: means over steps 2+
    for name, step, mean, top, probe in summary:
        print(f"| {name} | {step:.1f} | {summary[0][1] / step:.2f}x | {mean:.2e} | {top:.2e} | {probe:.2e} |")
    if args.peer:
        times = peer_run(args.steps)
        peer = statistics.median(times[1:])
        print(f"\npeer (TRL {version('trl')} GRPOTrainer, fp32): s/step " + ", ".join(f"{t:.1f}" for t in times)
              + f"; median (steps 2+) {peer:.1f} (load {load()})")
        for name, step, *_ in summary:
            print(f"| molt {name} | {step:.1f} s/step | {peer / step:.2f}x the peer's speed |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["actor", "suspects", "e2e"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--attn", default="molt_varlen,sdpa")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--precision", default="fp32", help="e2e: fp32,bf16 runs both (bf16: molt precision=bf16)")
    p.add_argument("--peer", action="store_true", help="e2e: then TRL's GRPOTrainer on the same workload")
    args, extra = p.parse_known_args()
    print(f"load average at start: {load()}")
    {"actor": actor_only, "suspects": suspects}.get(args.mode, lambda a: e2e(a, extra))(args)


if __name__ == "__main__":
    main()
