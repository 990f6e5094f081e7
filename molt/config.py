"""Structured config: the single source of defaults and types. YAML under conf/ holds choices.

Each dataclass is one Hydra config group (or a plain section of the run). Derived values are
computed once in `derived()` and logged with the run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional



@dataclass
class ModelConfig:
    name: str = "tiny"
    path: str = "${assets_dir}/tiny"  # local HF model directory (config, safetensors, tokenizer)
    build: str = "tiny"  # asset recipe that creates `path` when missing ("" = path must exist)
    dtype: str = "float32"  # actor parameter dtype on CPU
    master: Optional[bool] = None  # one rank: bf16 compute, fp32 masters in the optimizer (null: on a GPU only)


@dataclass
class FsdpConfig:
    """Parallel layout of the actor: world size = dp_size * ep_size * cp_size."""

    dp_size: int = 1
    ep_size: int = 1
    cp_size: int = 1
    offload: str = "none"  # none | optimizer


@dataclass
class EstimatorConfig:
    name: str = "grpo"
    std_normalize: bool = True  # grpo: divide by the group std (false = Dr. GRPO)
    eps: float = 1e-6
    teacher_path: str = ""  # opd: HF directory of the frozen teacher (must share the student's tokenizer)
    opd_coef: float = 1.0  # opd: A_t = -opd_coef (log p_student - log p_teacher)
    gamma: float = 1.0  # gae: discount per generated token
    lam: float = 0.95  # gae: GAE lambda
    critic_lr: float = 1e-3  # gae: the critic's own AdamW learning rate


@dataclass
class AgentConfig:
    mode: str = "env"  # env: the framework drives the LLM loop through the module's Env
    module: str = "experiments.quickstart.task"  # importable module providing the agent
    max_turns: int = 1  # assistant turns per rollout
    max_tokens_per_turn: int = 16  # generation budget of one assistant turn
    max_total_tokens: int = 256  # whole-rollout budget (prompt + observations + generations); chat: per request
    timeout_s: float = 0.0  # chat: wall-clock bound of one rollout's agent call (0 = none); past it, failed
    image_max_pixels: int = 4_194_304  # an image with more pixels (w*h) fails its rollout (molt/agents/images.py)
    image_max_per_prompt: int = 4  # more images in one rollout's prompt fail it; the engine's --limit-mm-per-prompt
    image_dir: str = ""  # local image paths are allowed only under this directory ("" = data URLs only)
    max_request_bytes: int = 4194304  # chat: larger request bodies are refused (413) before they are parsed
    harness: str = ""  # chat: the agent CLI run_cli runs, claude | codex (molt/agents/harness.py; "" = none)
    # chat: the reward of a rollout one of whose replies a budget cut (agent.max_tokens_per_turn, the context's room;
    # info["cut"] counts them); null = the agent's own. 0 stops RL from paying a reply that ran past its end
    cut_reward: Optional[float] = None
    log_dir: str = ""  # chat: run_cli appends each CLI's output to <log_dir>/<rollout id>.log ("" = not kept)
    verifiers: dict[str, Any] = field(default_factory=dict)  # verifiers mode: {env: verifiers' [env] block, path: [dirs
    # put on the bridge's sys.path, relative to the repo]} (molt/agents/verifiers.py, conf/agent/verifiers.yaml)


@dataclass
class EngineConfig:
    num_engines: int = 1
    dtype: str = "float32"
    max_model_len: int = 512
    enforce_eager: bool = True  # false = compiled graphs (CUDA graphs on GPU)
    enable_prefix_caching: bool = True
    speculative_config: Optional[str] = None  # JSON passed to --speculative-config
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    return_routed_experts: bool = False
    max_num_seqs: int = 256
    kv_cache_gb: int = 1  # VLLM_CPU_KVCACHE_SPACE on CPU
    cpu_threads_bind: str = "nobind"  # VLLM_CPU_OMP_THREADS_BIND; nobind: vLLM's worker runs in its engine-core process
    cpu_threads: int = 0  # the engine's OpenMP threads (OMP_NUM_THREADS) on CPU; 0 = one per core
    extra_args: list[str] = field(default_factory=list)  # more vLLM server flags, verbatim
    startup_timeout_s: float = 300.0
    request_timeout_s: float = 120.0
    sync: str = "reload"  # weight sync path: reload (CPU) | nccl (GPU clusters) | adapter (LoRA adapters only)
    sync_dir: str = "/dev/shm"  # where `reload` writes safetensors
    sync_bucket_mb: int = 1024  # `nccl`: weights gathered and broadcast this many MiB at a time (packed buffers)
    max_lora_rank: int = 16  # `adapter`: vLLM's --max-lora-rank (>= lora.rank; one of vLLM's allowed sizes)
    pause_mode: str = "wait"  # weight sync: wait (requests in flight finish first) | keep (they freeze and go on
    # under the new weights, each token labelled with its version; needs is_correction)
    probe_tol: float = 1e-3  # max |engine - actor| log-prob on the probe after each sync (bf16 GPU engines differ more)
    probe_tokens: int = 1024  # the probe: the first this many tokens of the step's first segment (images: all of it)
    base_port: int = 0  # 0 = pick free loopback ports
    uds: bool = True  # serve each engine on a Unix socket in a 0700 directory (false: TCP on 127.0.0.1, base_port)
    max_restarts: int = 3  # an engine that dies is restarted, synced and verified; more restarts than this within
    restart_window_s: float = 3600.0  # this many seconds stop the run (max_restarts=0: the first death stops it)


@dataclass
class RolloutConfig:
    n: int = 8  # samples per prompt (group size)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_inflight_groups: int = 32
    max_lag: int = 1  # staleness bound in weight versions (0 = synchronous on-policy)
    sticky: bool = True  # every request of a rollout to the engine of its first (its prefix is cached there)
    seed: Optional[int] = None  # seed every sampled request from (seed, group, turn, sample): the same weights and
    # data give the same tokens on any engine, after a retry or a resume (None = the engines' own randomness)


@dataclass
class TaskConfig:
    """A chat-template dataset: JSONL, one object per line with `messages` plus task fields."""

    name: str = "count"
    train_path: str = "${repo:}/experiments/quickstart/data/train.jsonl"
    eval_path: str = "${repo:}/experiments/quickstart/data/eval.jsonl"


@dataclass
class TrainConfig:
    steps: int = 100
    groups_per_step: int = 8
    lr: float = 1e-3
    warmup_steps: int = 0  # the policy's lr rises linearly, lr * k / warmup_steps at its k-th update (0 = constant lr)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    kl_coef: float = 0.0  # k3 KL penalty to a frozen copy of the initial policy (0 = no reference model loaded)
    row_tokens: int = 2048  # packed row length for the actor
    micro_batch_rows: int = 1  # rows per forward/backward (gradient accumulation inside a step)
    # the train step computes a group's shared prompt once per row (molt_varlen attention, the CPU default, without
    # context parallelism; flex_attention and sdpa compute it per sample): pack.py
    share_prefix: bool = True
    save_every: int = 0  # checkpoint every N steps (0 = only at the end)
    log_every: int = 10  # a line of main metrics on the terminal and in molt.log every N steps (MLflow gets all, every step)
    dump_rollouts: Optional[str] = None  # directory: write every step's rollouts as JSONL (trained and failed)
    replay_rollouts: Optional[str] = None  # a dump directory: train on its steps in order, generating nothing
    num_threads: int = 0  # torch intra-op threads for the actor (0 = torch default)
    activation_checkpointing: bool = False  # recompute decoder layers in backward (GPU memory; see actor/speed.py)
    compile: bool = False  # torch.compile the decoder layers and the log-prob head (GPU speed; see actor/speed.py)
    routing_replay: bool = False
    freeze_vision: bool = False  # vision-language policies: keep the vision tower and connector fixed


@dataclass
class LoraConfig:
    """LoRA (molt/actor/lora.py, peft): train low-rank adapters on the frozen base model; rank 0 = full fine-tuning."""

    rank: int = 0
    alpha: float = 32.0  # the update is alpha / rank * B A
    dropout: float = 0.0  # on the adapters' input, in the training forward only (scoring and the probe see none)
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    seed: int = 0  # A ~ kaiming-uniform from this seed (B = 0: training starts at the base model)
    # modules trained in full beside the adapters (peft's rule: a module whose name ends with one), e.g. [lm_head]
    modules_to_save: list[str] = field(default_factory=list)


@dataclass
class LossConfig:
    """The policy loss (molt/algo/loss.py LOSSES), one Hydra group: `loss=ppo_clip|gspo|cispo`."""

    name: str = "ppo_clip"
    clip_low: float = 0.2  # ppo_clip, gspo: ratio clip band [1 - clip_low, 1 + clip_high]; cispo: IS-weight band
    clip_high: float = 0.28


@dataclass
class IsCorrectionConfig:
    """Off-policy correction with the ratio actor / behaviour (see molt/algo/correction.py)."""

    level: str = "off"  # off | token | seq (product of a sequence's ratios) | geo (their geometric mean)
    mode: str = "mask"  # mask (0 outside [low, high]) | clip (clamp into it) | trunc (cap at high); seq/geo: mask
    low: float = 0.5
    high: float = 2.0


@dataclass
class FilterConfig:
    """Dynamic batch filtering: groups whose rewards are all equal carry no signal and are dropped."""

    enabled: bool = False
    max_drop_factor: float = 10.0  # stop the run when one step drops more than this x train.groups_per_step groups


@dataclass
class EvalConfig:
    every: int = 0  # evaluate on the held-out split every N steps (0 = never)
    max_samples: int = 64
    temperature: float = 0.0


@dataclass
class ViewConfig:
    """Trajectory pages (molt/view.py): <output_dir>/view/step_N.html, each also an MLflow artifact (view/)."""

    every: Optional[int] = None  # a page every N steps and at the last (None: on eval.every's steps; 0: no page)
    max_tokens: int = 500_000  # tokens on one page (~13 bytes each); the table lists every rollout (0 = no cap)


@dataclass
class ClusterConfig:
    """Where the run executes. launcher=slurm submits it through submitit (molt/cluster.py); the Slurm keys are
    ignored locally. Empty strings and 0 leave a Slurm setting to the cluster's default."""

    name: str = "local"
    launcher: str = "local"  # local: this process | slurm: sbatch through submitit (set by cluster=slurm)
    num_nodes: int = 1
    gpus_per_node: int = 0  # 0 = CPU
    gpu_memory_gib: float = 80.0  # per GPU; the dry-run planner flags a layout that needs more
    max_gpus_per_node: int = 0  # what the cluster's nodes have; gpus_per_node above it fails before submission
    tasks_per_node: int = 1  # Slurm tasks per node; each task is one Ray node
    engine_tasks: list[int] = field(default_factory=list)  # the Slurm task of each engine ([] = all on task 0,
    # beside the loop); an engine elsewhere runs in a Ray actor there, reached through Ray (rollout/engine.py)
    cpus_per_task: int = 0
    mem_gb: int = 0  # per node
    partition: str = ""
    account: str = ""
    qos: str = ""
    constraint: str = ""
    time_min: int = 60  # the job's time limit
    max_requeue: int = 3  # times a preempted or timed-out job is requeued (it resumes from its last checkpoint)
    python: str = ""  # the interpreter that runs each task ("" = this one's path); in an image, the image's own
    container_image: str = ""  # run every task in this image (a path or a registry reference)
    container_srun_args: list[str] = field(default_factory=lambda: ["--container-image={image}"])  # pyxis/enroot
    setup: list[str] = field(default_factory=list)  # shell lines run in the batch script before srun
    extra_sbatch: dict[str, Any] = field(default_factory=dict)  # more #SBATCH options, verbatim {"mail-type": "END"}
    extra_srun: list[str] = field(default_factory=list)  # more srun options, verbatim
    wait: bool = False  # block until the job ends and fail when it does (tests; a shell that stays open)


@dataclass
class RunConfig:
    name: str = "molt"
    seed: int = 0
    assets_dir: str = "${oc.env:MOLT_ASSETS,${repo:}/assets}"
    output_dir: Optional[str] = "${hydra:runtime.output_dir}"  # None outside a Hydra job (`--cfg job --resolve`)
    checkpoint_dir: str = "${repo:}/outputs/${name}/checkpoints"
    mlflow_uri: Optional[str] = None  # default: sqlite database under output_dir
    dry_run: bool = False
    resume: bool = False
    model: ModelConfig = field(default_factory=ModelConfig)
    fsdp: FsdpConfig = field(default_factory=FsdpConfig)
    estimator: EstimatorConfig = field(default_factory=EstimatorConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    view: ViewConfig = field(default_factory=ViewConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    is_correction: IsCorrectionConfig = field(default_factory=IsCorrectionConfig)
    filter: FilterConfig = field(default_factory=FilterConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)


REPO = Path(__file__).resolve().parent.parent


def register() -> None:
    """Put the schemas in Hydra's ConfigStore (imported here: the GPU image has no Hydra)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("repo"):
        OmegaConf.register_new_resolver("repo", lambda: str(REPO))
    cs = ConfigStore.instance()
    cs.store(name="molt_schema", node=RunConfig)
    for group, node in [("model", ModelConfig), ("fsdp", FsdpConfig), ("estimator", EstimatorConfig),
                        ("agent", AgentConfig), ("engine", EngineConfig), ("task", TaskConfig), ("loss", LossConfig),
                        ("cluster", ClusterConfig)]:
        cs.store(group=group, name=f"{group}_schema", node=node)


def derived(cfg: Any) -> dict:
    """Values computed once from the resolved config and logged beside it."""
    f = cfg.fsdp
    return {"world_size": f.dp_size * f.ep_size * f.cp_size,
            "samples_per_step": cfg.train.groups_per_step * cfg.rollout.n}
