"""The fixed cost of a quickstart step (issue 26 §3): the step piece by piece, then end to end against the reference.

    python experiments/benchmarks/step_cost.py                  # both parts
    python experiments/benchmarks/step_cost.py --part pieces    # one engine, one actor, no loop
    python experiments/benchmarks/step_cost.py --part loop --steps 60
    python experiments/benchmarks/step_cost.py --part loop --steps 60 --peer   # and TRL's GRPOTrainer (issue 26's peer)
    python experiments/benchmarks/step_cost.py --part loop --rounds 3 --variant train.share_prefix=false  # A/B
    python experiments/benchmarks/step_cost.py --part cpu      # CPU time per step of each process, both loops

The quickstart's workload: assets/tiny, 8 prompts x 8 samples, at most 4 new tokens, Molt's actor on one torch thread.

pieces (median of --reps repetitions after 3 warm-ups, each piece as the loop runs it):
- rollouts: 8 groups through the rollout worker's path (Env mode, run_group over the Router), with the engine requests
  it sent; beside it the engine alone (one seeded generate_n of 8 samples per prompt; when its first reply came, and
  its last), and one request of 64 samples of one prompt (the same batch to the engine core, all at once);
- handoff: a step's 8 groups (their pickled size) from the rollout worker to the loop, through a Ray queue as before,
  and held by the worker until the loop takes them (RolloutWorker.take, as molt/loop.py Popper does);
- train: Actor.train_step, and the reference GRPO step (experiments/benchmarks/reference_grpo.py) on the same batch;
- sync: each call of a weight sync (molt/sync/reload.py): export, safetensors written, pause, reload, caches dropped and
  version set, resume; the whole sync_weights; the probe (the actor's log-probs, the engine's);
- client CPU: this process's CPU time for a step's 8 generate requests, through the EngineClient (aiohttp) and through
  httpx (the client before it), alternating;
- mlflow: one step's metrics (as many as a quickstart step logs) to a sqlite store, in the caller's thread and queued
  (synchronous=False, as tracking.log_metrics does); and per step when ten steps' go in one transaction, as MLflow's
  logging thread writes them (molt/tracking.py buffers a second).

loop: `molt experiment=quickstart rollout.seed=0 eval.every=0 view.every=0` with rollout.max_lag=0 (synchronous) and 1
(asynchronous), and parity.py's reference loop (HF generate + the reference step, one process) with one torch thread
and with one per core (alone on the machine it is fastest with every core), --steps each, one after the other; per run
the median over steps 5.. of the wall time per step (Molt: between two steps' metrics, from their MLflow timestamps,
logging and checkpoints included) and of Molt's phases. --peer: TRL's GRPOTrainer too, after each reference loop and on
as many threads, on the same model, prompts (in TRL's order), reward and settings (experiments/benchmarks/cpu_step.py
peer_run), the median of its steps 5.. (TRL's own step callbacks). --variant: Molt's two runs again with one more
override. --rounds: all of it N times, interleaved, so that a shared machine's slow minutes hit every row alike; each
row prints the median and range over the rounds.

cpu: a quickstart run with max_lag=0, then 1 (until stopped); the CPU time per step of the driver and of every
process it started (Ray, the rollout worker, the engine's API server and core), from psutil over 20 s after 45 s.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import pickle
import statistics
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from experiments.benchmarks import parity  # noqa: E402
from experiments.benchmarks import reference_grpo as ref  # noqa: E402

GROUPS, N, TOKENS = 8, 8, 4


def ms(xs: list[float]) -> str:
    return f"{1000 * statistics.median(xs):8.1f} ms"


@contextlib.contextmanager
def timed(table: dict, name: str):
    """Appends the block's wall time to table[name]."""
    t0 = time.perf_counter()
    yield
    table.setdefault(name, []).append(time.perf_counter() - t0)


def quickstart_cfg():
    from hydra import compose, initialize_config_dir

    from molt.config import register

    register()
    with initialize_config_dir(str(REPO / "conf"), version_base=None):
        return compose("config", overrides=["experiment=quickstart", "rollout.seed=0"])


async def rollout_and_sync(client, cfg, model_dir: Path, actor, reps: int) -> tuple[dict, dict, list]:
    """Per rep: the rollouts, one train step on them, a weight sync with its probe; each piece timed. Returns the
    times, the counts and the last rep's groups."""
    import importlib

    from transformers import AutoTokenizer

    from molt.agents import load_agent, run_group
    from molt.agents.pool import sampling_params
    from molt.data import DataStream, load_jsonl
    from molt.loop import prepare
    from molt.rollout.router import Router
    from molt.sync import reload

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    agent = load_agent(cfg.agent.mode, importlib.import_module(cfg.agent.module))
    stream = DataStream(load_jsonl(cfg.task.train_path), seed=0)
    sent, real = [], client.generate_n

    async def counted(ids, max_tokens, n, **kw):
        sent.append(n)
        return await real(ids, max_tokens, n, **kw)

    client.generate_n = counted
    router, sampling = Router([client], seed=0), sampling_params(cfg.rollout)
    t, counts = {}, {}
    model = ref_model(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=0.0)
    for rep in range(reps + 3):
        t = {} if rep == 3 else t  # the first three are warm-ups
        rows = [stream.next() for _ in range(GROUPS)]
        sent.clear()
        with timed(t, "rollouts: 8 groups, the worker's path"):
            groups = await asyncio.gather(*(run_group(cfg.agent.mode, router, tok, agent, s, f"g{rep}.{i}", N,
                                                      cfg.agent, sampling, release=router.release) for i, s in rows))
        counts["engine requests per group"] = len(sent) / GROUPS
        prompts = [(s := g.rollouts[0].segments[0]).token_ids[:s.loss_mask.index(1)] for g in groups]
        t0 = time.perf_counter()

        async def reply(i: int, p: list[int]) -> float:
            await real(p, TOKENS, N, seed=rep * 100 + i, **sampling)
            return time.perf_counter() - t0

        with timed(t, "rollouts: the engine alone"):
            done = await asyncio.gather(*(reply(i, p) for i, p in enumerate(prompts)))
        t.setdefault("rollouts: the engine alone, its first reply", []).append(min(done))
        with timed(t, "rollouts: one request of 64 samples, one prompt"):
            await real(prompts[0], TOKENS, GROUPS * N, seed=rep, **sampling)
        for g in groups:
            g.index = 0
        counts["handoff: pickled bytes of 8 groups"] = len(pickle.dumps(groups))
        prep = prepare(groups, cfg, actor)
        with timed(t, "train: Actor.train_step"):
            actor.train_step(prep.segments, prep.advantages, cfg.rollout.temperature)
        samples = [(s.token_ids, s.loss_mask, s.logprobs) for s in prep.segments]
        with timed(t, "train: the reference step"):
            ref.grpo_step(model, opt, samples, torch.tensor(prep.advantages), cfg.train.grad_clip)
        with timed(t, "sync: export weights"):
            weights = actor.export_weights()
        with tempfile.TemporaryDirectory(dir=cfg.engine.sync_dir) as d:
            with timed(t, "sync: write safetensors"):
                reload.write_checkpoint(weights, d)
            with timed(t, "sync: pause"):
                await client.pause(cfg.engine.pause_mode)
            with timed(t, "sync: reload"):
                await client.reload_weights(d)
            with timed(t, "sync: drop caches, set version"):
                await asyncio.gather(client.drop_caches(), client.set_version(rep + 1))
            with timed(t, "sync: resume"):
                await client.resume()
        with timed(t, "sync: sync_weights"):  # write, pause, reload, drop caches and label, resume: as the loop does
            await reload.sync_weights([client], weights, rep + 1, cfg.engine.sync_dir, cfg.engine.pause_mode)
        probe = prep.segments[0]
        with timed(t, "sync: probe, the actor"):
            expected = actor.logprobs([probe], cfg.rollout.temperature)[0][1:]
        with timed(t, "sync: probe, the engine"):
            await reload.verify_sync(client, probe.token_ids, expected, cfg.engine.probe_tol)
    t |= await client_cost(client, prompts, sampling, reps)
    await client.aclose()
    return t, counts, groups


async def client_cost(client, prompts: list[list[int]], sampling: dict, reps: int) -> dict:
    """This process's CPU for a step's generate requests (one per group, n samples each): through the EngineClient
    (aiohttp), and the same requests through httpx (the client before it), alternating."""
    import json

    import httpx

    from molt.rollout.engine import SERVED_NAME, _endpoint

    base, uds = _endpoint(client.url)
    sp = dict(max_tokens=TOKENS, n=N, logprobs=0, detokenize=False, **sampling)
    http = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=uds), base_url=base, timeout=120, trust_env=False,
                             headers={"Authorization": f"Bearer {client.api_key}"})

    async def through_httpx(p):
        r = await http.post("/inference/v1/generate", json={"token_ids": p, "sampling_params": sp, "model": SERVED_NAME})
        return json.loads(r.text)

    ways = {"EngineClient (aiohttp)": lambda p: client.generate_n(p, TOKENS, N, **sampling), "httpx": through_httpx}
    t = {}
    for rep in range(reps + 3):
        for name, request in ways.items():
            c0 = time.process_time()
            await asyncio.gather(*(request(p) for p in prompts))
            if rep >= 3:
                t.setdefault(f"client CPU, 8 requests: {name}", []).append(time.process_time() - c0)
    await http.aclose()
    return t


def ref_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def handoff_cost(groups, reps: int, cfg, client, model_dir: Path) -> dict:
    """A step's 8 finished groups from the rollout worker to the loop: through a Ray queue, as the loop took them
    before (the worker's put of the 8, then a get, qsize and get_nowait_batch), and held by the worker until the loop
    takes them (RolloutWorker.take, one call; the worker's side is a list append)."""
    import ray
    from omegaconf import OmegaConf
    from ray.util.queue import Queue

    from molt.agents.pool import RolloutWorker

    cfg = OmegaConf.merge(cfg, {"output_dir": tempfile.gettempdir()})  # plain values, as the loop hands it over
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        q, worker, t = Queue(), RolloutWorker.remote(cfg, [client], str(model_dir), 0), {}
        items = [("group", g) for g in groups]
        for rep in range(reps + 3):
            t = {} if rep == 3 else t
            with timed(t, "handoff: 8 groups, a Ray queue (before)"):
                q.put_nowait_batch(items)
                got = [q.get(timeout=10)]
                got += q.get_nowait_batch(q.qsize())
            for item in items:
                ray.get(worker._emit.remote(item))
            with timed(t, "handoff: 8 groups, RolloutWorker.take"):
                took, _ = ray.get(worker.take.remote(10.0))
            assert len(got) == len(took) == len(items)
        return t
    finally:
        ray.shutdown()


def mlflow_cost(reps: int, metrics: int = 60) -> dict:
    import mlflow
    from mlflow.entities import Metric

    with tempfile.TemporaryDirectory() as d:
        mlflow.set_tracking_uri(f"sqlite:///{d}/mlflow.db")
        t = {}
        with mlflow.start_run():
            values = {f"m/{i}": float(i) for i in range(metrics)}
            for rep in range(reps + 3):
                t = {} if rep == 3 else t
                with timed(t, f"mlflow: {metrics} metrics, in the caller"):
                    mlflow.log_metrics(values, step=2 * rep)
                with timed(t, f"mlflow: {metrics} metrics, queued"):
                    mlflow.log_metrics(values, step=2 * rep + 1, synchronous=False)
            mlflow.flush_async_logging()
            client, run_id, now = mlflow.MlflowClient(), mlflow.active_run().info.run_id, int(time.time() * 1000)
            batched = {}  # as the logging thread writes them (tracking.py: a second's worth at once)
            for rep in range(reps + 3):
                batch = [Metric(k, v, now, 1000 + 10 * rep + s) for s in range(10) for k, v in values.items()]
                with timed(batched, "mlflow: per step, 10 steps in one transaction"):
                    client.log_batch(run_id, metrics=batch)
        return t | {k: [x / 10 for x in xs[3:]] for k, xs in batched.items()}


def pieces(reps: int) -> None:
    from molt.actor.actor import Actor
    from molt.assets import ensure_model
    from molt.rollout.engine import launch_engines

    cfg = quickstart_cfg()
    model_dir = ensure_model(REPO / "assets/tiny", "tiny")
    torch.manual_seed(0)
    actor = Actor(model_dir, cfg.train)  # train.num_threads=1, as the quickstart's actor
    with tempfile.TemporaryDirectory() as logs, launch_engines(cfg.engine, model_dir, logs) as servers:
        t, counts, groups = asyncio.run(rollout_and_sync(servers[0].client(), cfg, model_dir, actor, reps))
        t |= handoff_cost(groups, reps, cfg, servers[0].client(), model_dir) | mlflow_cost(reps)
    print(f"\npieces of a quickstart step (median of {reps})")
    for name, xs in t.items():
        print(f"  {name:44s} {ms(xs)}")
    for name, v in counts.items():
        print(f"  {name:44s} {v:11.1f}")


def peer_quickstart(steps: int, model_dir: Path, threads: int) -> list[float]:
    """TRL's GRPOTrainer on the quickstart (its model, prompts, reward and settings: 8 x 8, 4 new tokens, lr 2e-3,
    clip 1, no KL, fp32) on `threads` torch threads; the wall time of each step."""
    from experiments.benchmarks.cpu_step import peer_run
    from experiments.quickstart import task
    from molt.data import load_jsonl

    def reward(completions, answer, **kw):
        return [task.reward(c[-1]["content"], a) for c, a in zip(completions, answer)]

    rows = [{"prompt": r["messages"], "answer": r["answer"]}
            for r in load_jsonl(REPO / "experiments/quickstart/data/train.jsonl")]
    torch.set_num_threads(threads)
    return peer_run(steps, model_dir, rows, reward, max_new=parity.SETTINGS["max_new_tokens"], lr=parity.SETTINGS["lr"])


def loop(steps: int, out: Path, peer: bool = False, rounds: int = 1, variants: tuple[str, ...] = ("",)) -> None:
    """Molt synchronous, Molt asynchronous (each once per `variants` override, "" = as configured), the reference loop
    (and with `peer`, TRL's GRPOTrainer), `rounds` times interleaved: per run the median s/step and Molt's phases over
    steps 5.., then per row the median over the rounds (and their range)."""
    from molt.assets import ensure_model

    model_dir = ensure_model(REPO / "assets/tiny", "tiny")
    rows: dict[str, list[dict]] = {}
    for r in range(rounds):
        for v in variants:
            for lag in (0, 1):
                extra = [f"rollout.max_lag={lag}", *([v] if v else [])]
                res = parity.molt_run(0, steps, out / f"round{r}", extra=extra, keys=PHASES)
                rows.setdefault(f"molt, max_lag={lag}" + (f", {v}" if v else ""), []).append(res)
        for threads in sorted({1, os.cpu_count()}):  # one, as the quickstart's actor, and every core: its best alone
            rows.setdefault(f"reference loop, {threads} thread(s)", []).append(
                parity.reference_run(0, steps, model_dir, threads))
            if peer:
                rows.setdefault(f"peer (TRL {version('trl')}), {threads} thread(s)", []).append(
                    {"step_s": peer_quickstart(steps, model_dir, threads)})
    med = lambda xs: statistics.median(xs[5:])  # noqa: E731
    print(f"\nquickstart, {steps} steps each, {rounds} round(s): medians over steps 5..{steps - 1}, then over rounds")
    print(f"  {'':44s} {'s/step':>8s} {'range':>15s} " + " ".join(f"{k.removeprefix('time/'):>9s}" for k in PHASES))
    for name, runs in rows.items():
        walls = [med(res.get("wall_s", res["step_s"])) for res in runs]
        phases = " ".join(f"{statistics.median(med(res[k]) for res in runs):9.4f}" if runs[0].get(k) else f"{'':9s}"
                          for k in PHASES)
        print(f"  {name:44s} {statistics.median(walls):8.4f} {min(walls):7.4f}-{max(walls):.4f} {phases}")


def cpu(out: Path, lag: int = 1, warm_s: float = 45, span_s: float = 20) -> None:
    """CPU time per step of every process of a quickstart run (the driver and all it started: Ray, the rollout
    worker, the engine's API server and core), over span_s seconds after warm_s, from psutil; steps counted in the
    run's MLflow store."""
    import os
    import sqlite3
    import subprocess

    import psutil

    run = out / f"cpu_max_lag{lag}"
    cmd = [sys.executable, "-m", "molt", "experiment=quickstart", f"rollout.max_lag={lag}", "train.steps=100000",
           "eval.every=0", "view.every=0", f"hydra.run.dir={run}", f"checkpoint_dir={run / 'ckpt'}"]
    driver = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1"),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def snapshot() -> tuple[int, dict]:
        with sqlite3.connect(run / "mlflow.db") as db:
            step = db.execute("select count(*) from metrics where key = 'reward/mean'").fetchone()[0]
        times = {}
        for p in [psutil.Process(driver.pid), *psutil.Process(driver.pid).children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                times[p.pid] = (sum(p.cpu_times()[:2]), " ".join(p.cmdline()).replace(f"{REPO}/", "")[:60] or p.name())
        return step, times

    try:
        time.sleep(warm_s)
        (s0, t0), w0 = snapshot(), time.time()
        time.sleep(span_s)
        (s1, t1), w1 = snapshot(), time.time()
    finally:
        driver.terminate()
        driver.wait()
    n = s1 - s0
    print(f"\nCPU per step, max_lag={lag}: {n} steps in {w1 - w0:.1f} s ({(w1 - w0) / n:.4f} s/step, "
          f"{psutil.cpu_count()} cores)")
    rows = sorted(((t1[k][0] - t0.get(k, (0.0,))[0]) / n, t1[k][1]) for k in t1)
    for sec, name in reversed(rows):
        if sec >= 5e-4:
            print(f"  {1000 * sec:7.1f} ms  {name}")
    print(f"  {1000 * sum(sec for sec, _ in rows):7.1f} ms  in all")


PHASES = ("time/wait", "time/generate", "time/train", "time/sync", "time/other")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["both", "pieces", "loop", "cpu"], default="both")
    ap.add_argument("--reps", type=int, default=30, help="pieces: repetitions of each")
    ap.add_argument("--steps", type=int, default=60, help="loop: steps of each run")
    ap.add_argument("--out", default=str(REPO / "outputs/step_cost"), help="loop: where the molt runs go")
    ap.add_argument("--peer", action="store_true", help="loop: TRL's GRPOTrainer on the quickstart too")
    ap.add_argument("--rounds", type=int, default=1, help="loop: run everything this many times, interleaved")
    ap.add_argument("--variant", action="append", default=[],
                    help="loop: Molt again with this override too (repeatable), e.g. train.share_prefix=false")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.part in ("both", "pieces"):
        pieces(a.reps)
    if a.part in ("both", "loop"):
        loop(a.steps, Path(a.out), a.peer, a.rounds, ("", *a.variant))
    if a.part == "cpu":
        for lag in (0, 1):
            cpu(Path(a.out), lag)


if __name__ == "__main__":
    main()
