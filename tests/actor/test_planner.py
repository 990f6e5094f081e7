"""The dry-run planner: the real layout on a meta model and a fake process group, numbers checked by hand."""
import json
import math
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from molt.actor.planner import GIB, format_plan, plan_memory, read_shards
from molt.assets import tiny_config
from molt.config import REPO, RunConfig

ARCH = REPO / "conf" / "arch"
# DeepSeek-V3 by hand: 61 layers, the first 3 dense; each MoE layer has 256 experts of gate+up+down (3 x H x I)
H, V, I_MOE, L = 7168, 129280, 2048, 61
ROUTED = (L - 3) * 256 * 3 * H * I_MOE  # 653.9B
# a tiny Mixtral: its experts are counted in num_local_experts and sized by intermediate_size (no dense MLP)
MIXTRAL = dict({k: v for k, v in tiny_config().items() if k not in ("model_type", "architectures")},
               model_type="mixtral", architectures=["MixtralForCausalLM"], intermediate_size=64, num_local_experts=4,
               num_experts_per_tok=2)


def run_config(model: str, dp=1, ep=1, cp=1, nodes=1, gpus=8, **train) -> RunConfig:
    cfg = RunConfig()
    cfg.model.name, cfg.model.path = model, str(ARCH / model)
    cfg.fsdp.dp_size, cfg.fsdp.ep_size, cfg.fsdp.cp_size = dp, ep, cp
    cfg.cluster.num_nodes, cfg.cluster.gpus_per_node, cfg.cluster.gpu_memory_gib = nodes, gpus, 79.0
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg


@pytest.fixture(scope="module")
def ep256():
    cfg = run_config("deepseek_v3_671b", dp=2, ep=256, nodes=64, activation_checkpointing=True)
    start = time.perf_counter()
    shards = read_shards(cfg)
    plan = plan_memory(cfg)
    return cfg, shards, plan, time.perf_counter() - start


def test_671b_at_ep256_is_planned_in_under_a_minute(ep256):
    cfg, (total, routed, local, local_expert, units, *_), plan, seconds = ep256
    assert seconds < 60
    assert routed == ROUTED and 665e9 < total < 675e9  # the published ~671B (MTP layer excluded)
    world = 2 * 256
    # experts: sharded over ep (different experts), then FSDP over dp x cp (the same experts)
    assert local_expert == ROUTED // world, (local_expert, ROUTED / world)
    dense = total - routed  # attention, shared experts, dense MLPs, routers, norms, embeddings: over every rank
    assert dense / world <= local - local_expert <= 1.025 * dense / world  # FSDP pads dim 0 up to a multiple
    root, layers = units
    assert root == 2 * V * H + H  # the root gathers embeddings, head and the final norm
    assert layers[0] == (1536 * H + 1536 + 128 * 192 * 1536 + 576 * H + 512 + 128 * 256 * 512 + 128 * 128 * H
                         + 3 * H * 18432 + 2 * H)  # a dense layer: MLA, its norms, the 18432-wide MLP, 2 norms
    assert not dist.is_initialized()  # the fake group is gone


def test_671b_bytes_follow_the_formulas(ep256):
    cfg, (_, _, local, *_), plan, _ = ep256
    assert plan.gpu["params"] == 4 * local and plan.gpu["grads"] == 4 * local  # fp32 master + fp32 grads
    assert plan.gpu["optimizer"] == 8 * local  # AdamW: two fp32 moments
    # one MoE layer per token: norms 4H, MLA (q/kv bottlenecks + 128 heads x (2 x 192 + 2 x 128)),
    # 8 routed (2H + 4I) + 1 shared 4I, fp32 router logits over 256 experts
    layer = 4 * H + (1536 + 512 + 64 + 128 * (2 * 192 + 2 * 128)) + 8 * (2 * H + 4 * I_MOE) + 4 * I_MOE + 2 * 256
    acts = 2048 * 2 * ((L + 1) * H + layer) + 1024 * V * (2 + 8)  # checkpointed hiddens + one layer + logit chunk
    assert plan.gpu["activations"] == acts
    assert plan.gpu["runtime"] == 3 * GIB and plan.fits and plan.gpu_total < 79 * GIB
    assert "fits" in format_plan(plan, cfg) and "DOES NOT FIT" not in format_plan(plan, cfg)


def test_a_layout_that_cannot_fit_is_flagged_with_the_fix():
    cfg = run_config("deepseek_v3_671b", ep=8, activation_checkpointing=True)  # 671B on one node
    plan = plan_memory(cfg)
    assert not plan.fits and plan.gpu["optimizer"] > 600 * GIB  # 82B experts per GPU x 8 B
    text = format_plan(plan, cfg)
    assert "DOES NOT FIT" in text and "fsdp.offload=optimizer" in text and "fsdp.ep_size=8" in text
    cfg.fsdp.offload = "optimizer"  # the sharded state moves to the host; the GPU keeps gathered layers
    offloaded = plan_memory(cfg)
    assert set(offloaded.host) == {"params", "grads", "optimizer"} and "optimizer" not in offloaded.gpu
    assert offloaded.host["optimizer"] == plan.gpu["optimizer"] and offloaded.fits


def test_activations_that_cannot_fit_name_checkpointing():
    cfg = run_config("deepseek_v3_671b", dp=2, ep=256, nodes=64, activation_checkpointing=False)
    plan = plan_memory(cfg)
    assert not plan.fits and max(plan.gpu, key=plan.gpu.get) == "activations"
    assert "train.activation_checkpointing=true" in format_plan(plan, cfg)


def test_qwen3_30b_a3b_plan_with_cp():
    cfg = run_config("qwen3_30b_a3b", dp=2, ep=4, cp=2, nodes=2, activation_checkpointing=True)
    total, routed, local, local_expert, *_ = read_shards(cfg)
    assert routed == 48 * 128 * 3 * 2048 * 768 and math.isclose(total, 30.53e9, rel_tol=1e-3)
    assert local_expert == routed // 16  # 32 experts per ep rank, FSDP over dp x cp = 4
    plan = plan_memory(cfg)
    assert plan.tokens == 2048 // 2 and plan.fits  # each cp rank holds half of every row
    cfg.cluster.gpus_per_node = 0  # CPU ranks: everything in model.dtype (float32), nothing to fit into
    cpu = plan_memory(cfg)
    assert cpu.gpu["params"] == 4 * local and cpu.capacity_gib == 0 and "memory/rank" in format_plan(cpu, cfg)
    logits = 1024 * 151936  # one head chunk: bf16 logits + fp32 copy + fp32 grad on GPU, 3 x fp32 on CPU
    assert cpu.gpu["activations"] - 12 * logits == 2 * (plan.gpu["activations"] - 10 * logits)  # fp32 vs bf16


def test_one_gpu_plans_fp32_masters_in_the_optimizer_and_no_fsdp():
    """World size 1 on a GPU (molt/actor/master.py): bf16 weights + fp32 masters, bf16 grads, fp32 moments, and no
    gathered layers; with offload it keeps FSDP2 (fp32 params on the host)."""
    cfg = run_config("qwen3_30b_a3b", gpus=1, activation_checkpointing=True)
    total = read_shards(cfg)[0]
    plan = plan_memory(cfg)
    assert plan.gpu["params"] == 6 * total and plan.gpu["grads"] == 2 * total and plan.gpu["optimizer"] == 8 * total
    assert plan.gpu["gathered"] == 0 and not plan.fits  # 30B x 16 B on one 79 GiB GPU
    cfg.fsdp.offload = "optimizer"
    assert plan_memory(cfg).host["params"] == 4 * total
    cfg = run_config("qwen3_30b_a3b", gpus=0, activation_checkpointing=True)
    cfg.model.master = True  # precision=bf16 on CPU: the same bytes
    plan = plan_memory(cfg)
    assert plan.gpu["params"] == 6 * total and plan.gpu["grads"] == 2 * total


def test_lora_plans_the_frozen_base_and_the_adapters_state():
    """lora.rank > 0: the adapters are put in as the actor does; only they have grads and AdamW moments. One GPU:
    everything in bf16, fp32 masters of the adapters; 16 ranks: fp32 shards of the base and the adapters."""
    cfg = run_config("qwen3_30b_a3b", gpus=1, activation_checkpointing=True)
    cfg.lora.rank = 16  # q, k, v, o: the attention of an MoE model
    total, _, local, _, _, adapters, _ = read_shards(cfg)
    assert math.isclose(total, 30.53e9, rel_tol=1e-3)  # the base alone
    assert adapters == 48 * 16 * ((2048 + 4096) + 2 * (2048 + 512) + (4096 + 2048))  # r x (in + out) per target
    plan = plan_memory(cfg)
    assert plan.gpu["params"] == 2 * (total + adapters) + 4 * adapters and plan.gpu["grads"] == 2 * adapters
    assert plan.gpu["optimizer"] == 8 * adapters and plan.gpu["gathered"] == 0
    assert plan.fits  # full fine-tuning does not fit this GPU (above): 16 B per element against 2 B + the adapters
    assert "LoRA adapter elements (rank 16)" in format_plan(plan, cfg)
    cfg.lora.modules_to_save = ["lm_head"]  # trained in full: its grads and moments join the adapters'
    saved = read_shards(cfg)[6]
    assert saved == 151936 * 2048 and plan_memory(cfg).gpu["grads"] == 2 * (adapters + saved)
    cfg = run_config("qwen3_30b_a3b", dp=2, ep=4, cp=2, nodes=2, activation_checkpointing=True)
    cfg.lora.rank = 16
    _, _, local, _, _, adapters, _ = read_shards(cfg)
    plan = plan_memory(cfg)
    assert plan.gpu["params"] == 4 * (local + adapters) and plan.gpu["grads"] == 4 * adapters
    assert plan.gpu["optimizer"] == 8 * adapters and 13_369_344 / 16 <= adapters <= 1.01 * 13_369_344 / 16


def test_mixtral_style_config_is_planned_as_moe(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL))
    cfg = run_config("mixtral", ep=2, gpus=2, activation_checkpointing=True)
    cfg.model.path = str(tmp_path)
    total, routed, local, local_expert, *_ = read_shards(cfg)
    assert routed == 2 * 4 * 3 * 128 * 64 and local_expert == routed // 2  # 2 of the 4 experts per ep rank
    # per token: norms 4H, q k v o 2 x 4 x 32 + 2 x 2 x 32, 2 routed experts x (2H + 4I) and fp32 router logits over 4
    layer = 4 * 128 + (256 + 128) + 2 * (2 * 128 + 4 * 64) + 2 * 4
    assert f"+ {layer} of one layer" in plan_memory(cfg).notes["activations"]


def test_planner_never_replaces_the_callers_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="not initialised"):
            plan_memory(run_config("qwen3_30b_a3b", ep=2, gpus=0))
        assert dist.get_backend() == "gloo"
    finally:
        dist.destroy_process_group()


def test_dry_run_prints_the_memory_table(tmp_path):
    out = subprocess.run([sys.executable, "-m", "molt", "dry_run=true", "model=deepseek_v3_671b", "cluster=h100_64x8",
                          "fsdp.ep_size=256", "fsdp.dp_size=2", "train.activation_checkpointing=true",
                          f"hydra.run.dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "dp 2 x ep 256 x cp 1 = 512 ranks on 64 x 8 GPUs" in out.stdout and "fits" in out.stdout, out.stdout
