"""Dry-run memory planner: the per-rank memory of a parallel layout, without weights, GPUs or peers.

    plan = plan_memory(cfg)          # cfg: the resolved run (RunConfig or its OmegaConf node)
    print(format_plan(plan, cfg))    # `molt dry_run=true ...` prints this after the process plan

The model is built on the meta device from its config.json, the real layout (`parallelize`) is applied
on a fake process group of the layout's world size (collectives are no-ops, only rank 0 is simulated;
FSDP2 gives rank 0 the largest shard, so it is the worst case), and every number below is read from the
resulting local shards. Only activations are estimated, by a formula (`activation_bytes`).

Bytes per sharded parameter element (AdamW): on GPU the sharded params are the fp32 master copy
(bf16 only while gathered for compute), so params 4 + grads 4 + two AdamW moments 8 = 16 B; one GPU rank
without offload has no FSDP (bf16 params 2 + fp32 masters 4 + bf16 grads 2 + moments 8, nothing gathered);
on CPU everything is in model.dtype. `fsdp.offload=optimizer` keeps all of these on the host
(FSDP2 CPUOffloadPolicy: the optimizer step runs there), leaving the gathered layers on the GPU.
With LoRA (lora.rank > 0) the base is frozen: grads, moments and fp32 masters are the adapters' only.
Assumed, not measured: balanced expert routing (each ep rank computes its share, k x tokens on
average; a skewed router sends more) and RUNTIME_GIB for the CUDA context, NCCL and fragmentation.
"""
from __future__ import annotations

import shlex
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM

from molt.actor import lora
from molt.actor.vision import is_vision
from molt.assets import hf_config, model_facts
from molt.config import FsdpConfig, derived

GIB = 2**30
RUNTIME_GIB = 3.0  # per GPU: CUDA context + NCCL buffers + allocator fragmentation (a rule of thumb)


@dataclass
class Plan:
    layout: str  # "<model> <params>, dp 2 x ep 256 x cp 1 = 512 ranks on ..."
    tokens: int  # tokens per rank in one micro-batch
    gpu: dict[str, float]  # what -> bytes on one GPU (or one rank's memory on CPU)
    host: dict[str, float]  # what -> bytes on the host, per rank
    notes: dict[str, str]  # what -> how it was counted
    capacity_gib: float  # cluster.gpu_memory_gib (0 on CPU: nothing is checked)

    @property
    def gpu_total(self) -> float:
        return sum(self.gpu.values())

    @property
    def fits(self) -> bool:
        return not self.capacity_gib or self.gpu_total <= self.capacity_gib * GIB


@contextmanager
def fake_world(world_size: int):
    """A default process group of `world_size` ranks that never communicates (this process is rank 0)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # importing it registers the "fake" backend

    if dist.is_initialized():  # one default group per process: never replace the caller's
        raise RuntimeError("the dry-run planner needs its own default process group: call it from a process "
                           "where torch.distributed is not initialised (e.g. the `molt` driver)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def local_numel(t: torch.Tensor) -> int:
    return (t.to_local() if isinstance(t, DTensor) else t).numel()


def gathered_sizes(model) -> tuple[int, list[int]]:
    """Unsharded elements FSDP gathers (a DTensor's numel is its global size): the root (embeddings, final norm,
    head; kept gathered through forward and backward) and each decoder layer with its experts, largest first."""
    layers = sorted((sum(p.numel() for p in layer.parameters()) for layer in model.base_model.layers), reverse=True)
    return sum(p.numel() for p in model.parameters()) - sum(layers), layers


def layer_activation_elems(hf: dict) -> int:
    """Elements one decoder layer keeps for backward per token (the larger of dense and MoE layers),
    in the spirit of Korthikanti et al. 2022 (arXiv:2205.05198) with flash attention (no s x s scores):
    2 RMSNorms x (input + output) + q, k, v, attention output; SwiGLU keeps gate, up, act and their
    product (4 I). A routed token is dispatched to k experts (k x (hidden in + out + 4 I)), plus
    shared experts and the fp32 router logits."""
    h, nq, facts = hf["hidden_size"], hf["num_attention_heads"], model_facts(hf)
    if hf.get("kv_lora_rank"):  # MLA: low-rank q/kv bottlenecks, then per-head q, k (nope + rope), v
        qk, v = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"], hf["v_head_dim"]
        attn = (hf.get("q_lora_rank") or 0) + hf["kv_lora_rank"] + hf["qk_rope_head_dim"] + nq * (2 * qk + 2 * v)
    else:
        attn = 2 * nq * facts.head_dim + 2 * hf.get("num_key_value_heads", nq) * facts.head_dim
    dense = 4 * hf["intermediate_size"]
    i, shared = facts.expert_size, hf.get("n_shared_experts") or 0
    moe = facts.top_k * (2 * h + 4 * i) + 4 * i * shared + 2 * facts.experts  # 0 for a dense model
    return 4 * h + attn + max(dense, moe)


def activation_bytes(hf: dict, tokens: int, nbytes: int, checkpointing: bool) -> tuple[float, str]:
    """Estimated activation memory of one micro-batch (tokens on this rank), and the formula used.
    Checkpointing keeps each layer's input hidden (L+1 of them, with the final norm's) and, in
    backward, one layer's full activations at a time; without it every layer keeps everything. The
    head computes logits in chunks of HEAD_CHUNK tokens (compute-dtype logits, fp32 copy, fp32 grad)."""
    from molt.actor.actor import HEAD_CHUNK

    n_layers, h, elems = hf["num_hidden_layers"], hf["hidden_size"], layer_activation_elems(hf)
    head = min(tokens, HEAD_CHUNK) * hf["vocab_size"] * (nbytes + 8)
    if checkpointing:
        body = tokens * nbytes * ((n_layers + 1) * h + elems)
        how = f"{tokens} tok x {nbytes} B x ((L+1) x {h} + {elems} of one layer)"
    else:
        body = tokens * nbytes * n_layers * (h + elems)
        how = f"{tokens} tok x {nbytes} B x L x ({h} + {elems})"
    return body + head, how + f" + logits {min(tokens, HEAD_CHUNK)} x {hf['vocab_size']} x {nbytes + 8} B"


def shard_model(model: torch.nn.Module, cfg) -> torch.nn.Module:
    """The run's layout applied on the (fake) default group. Offload does not change shard sizes, and
    CPUOffloadPolicy would copy meta tensors to the host, so offload is left to the accounting."""
    from molt.actor.parallel import build_mesh, parallelize

    fsdp = FsdpConfig(cfg.fsdp.dp_size, cfg.fsdp.ep_size, cfg.fsdp.cp_size, offload="none")
    mesh = build_mesh(fsdp, "cpu")  # a fake group on any device type: cpu needs no accelerator here
    return parallelize(model, mesh, fsdp, mixed_precision=cfg.cluster.gpus_per_node > 0)


def bytes_per_element(cfg) -> tuple[int, int]:
    """(sharded state, compute) bytes per element: fp32 master + bf16 compute on GPU or with model.master, else
    model.dtype on CPU."""
    if cfg.cluster.gpus_per_node > 0 or cfg.model.master:
        return 4, 2
    size = torch.empty((), dtype=getattr(torch, cfg.model.dtype)).element_size()
    return size, size


def read_shards(cfg) -> tuple[int, int, int, int, tuple[int, list[int]], int, int]:
    """(total params, total routed-expert params, local params, local expert params, gathered sizes, local LoRA
    adapter params, local params of lora.modules_to_save) of the layout; with lora.rank > 0 the adapters are in, as
    the actor puts them in (lora.inject)."""
    is_expert = lambda n, p: n.endswith(("gate_up_proj", "down_proj")) and p.dim() == 3  # noqa: E731  fused experts
    with fake_world(derived(cfg)["world_size"]):
        with torch.device("meta"):  # no storage behind the parameters
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(cfg.model.path)))
            if cfg.lora.rank > 0:
                lora.inject(model, cfg.lora)
        total = sum(p.numel() for n, p in model.named_parameters() if not lora.is_adapter(n))
        total_expert = sum(p.numel() for n, p in model.named_parameters() if is_expert(n, p))
        model = shard_model(model, cfg)
        local = sum(local_numel(p) for n, p in model.named_parameters() if not lora.is_adapter(n))
        local_expert = sum(local_numel(p) for n, p in model.named_parameters() if is_expert(n, p))
        adapters = sum(local_numel(p) for n, p in model.named_parameters() if lora.is_adapter(n))
        saved = sum(local_numel(p) for n, p in model.named_parameters()
                    if cfg.lora.rank > 0 and p.requires_grad and not lora.is_adapter(n))
        return total, total_expert, local, local_expert, gathered_sizes(model), adapters, saved


def plan_memory(cfg) -> Plan:
    """Per-rank memory of cfg's layout for cfg.model (a directory with config.json), read from real shards."""
    f, c, t = cfg.fsdp, cfg.cluster, cfg.train
    hf = AutoConfig.from_pretrained(str(cfg.model.path)).to_dict()
    state_bytes, compute_bytes = bytes_per_element(cfg)
    total, total_expert, params, expert, (root, layers), adapters, saved = read_shards(cfg)
    tokens = t.micro_batch_rows * t.row_tokens // f.cp_size
    acts, how = activation_bytes(hf, tokens, compute_bytes, t.activation_checkpointing)
    layers = layers[:2]
    offload = f.offload == "optimizer"
    master = cfg.model.master if cfg.model.master is not None else (  # molt/actor/master.py, as Actor decides
        c.gpus_per_node > 0 and derived(cfg)["world_size"] == 1 and not offload)
    # LoRA: the base is frozen (no grads, no moments) but for lora.modules_to_save
    trained = adapters + saved if cfg.lora.rank > 0 else params
    if master:  # every weight in bf16; the trained ones also as fp32 masters, with bf16 grads
        states = {"params": (params + adapters) * compute_bytes + trained * 4, "grads": trained * compute_bytes}
    else:
        states = {"params": (params + adapters) * state_bytes, "grads": trained * state_bytes}
    states["optimizer"] = 2 * trained * (4 if master else state_bytes)
    gpu = {} if offload else dict(states)
    # gathered for compute: the root (embeddings, head: kept through forward and backward) and two layers
    # (one computing, one prefetched); backward reduce-scatters one layer's grads in fp32
    scattered = 0 if cfg.lora.rank > 0 else 4 * (layers[0] if layers else root)  # LoRA: the adapters' grads only
    gpu["gathered"] = 0 if master else compute_bytes * (root + sum(layers)) + scattered
    gpu["activations"] = acts
    if c.gpus_per_node:
        gpu["runtime"] = RUNTIME_GIB * GIB
    notes = {"params": f"{params / 1e9:.3f}B elements x {state_bytes} B ({expert / 1e9:.3f}B of them experts)",
             "grads": f"x {state_bytes} B", "optimizer": f"AdamW: 2 moments x {state_bytes} B",
             "gathered": f"{compute_bytes} B x (root {root / 1e6:.0f}M + 2 layers {sum(layers) / 1e6:.0f}M) "
                         f"+ 4 B x reduce-scatter {(layers[0] if layers else root) / 1e6:.0f}M",
             "activations": how, "runtime": "CUDA context, NCCL buffers, fragmentation (rule of thumb)"}
    if master:
        notes |= {"params": f"{params / 1e9:.3f}B elements x (2 B bf16 + 4 B fp32 master in the optimizer)",
                  "grads": "x 2 B (bf16)", "optimizer": "AdamW: 2 moments x 4 B", "gathered": "one rank: no FSDP"}
    if cfg.lora.rank > 0:
        whose = "the adapters' only" + (f" and {saved / 1e6:.2f}M of lora.modules_to_save" if saved else "")
        notes |= {"params": f"{params / 1e9:.3f}B frozen base elements x {compute_bytes if master else state_bytes} B "
                            f"+ {adapters / 1e6:.2f}M LoRA adapter elements (rank {cfg.lora.rank}) x "
                            f"{compute_bytes + 4 if master else state_bytes} B",
                  "grads": f"{whose}, x {compute_bytes if master else state_bytes} B",
                  "optimizer": f"AdamW: 2 moments x {4 if master else state_bytes} B, {whose}"}
        if not master:
            notes["gathered"] = f"{compute_bytes} B x (root {root / 1e6:.0f}M + 2 layers {sum(layers) / 1e6:.0f}M)"
    world = derived(cfg)["world_size"]
    where = f"{c.num_nodes} x {c.gpus_per_node} GPUs of {c.gpu_memory_gib:g} GiB" if c.gpus_per_node else "cpu"
    layout = (f"{cfg.model.name} {total / 1e9:.2f}B params ({total_expert / 1e9:.2f}B routed experts), "
              f"dp {f.dp_size} x ep {f.ep_size} x cp {f.cp_size} = {world} ranks on {where}")
    return Plan(layout, tokens, gpu, states if offload else {}, notes, c.gpu_memory_gib if c.gpus_per_node else 0.0)


def advice(plan: Plan, cfg) -> str:
    """What to change when the plan does not fit: attack the largest item."""
    f, t = cfg.fsdp, cfg.train
    big = max(plan.gpu, key=plan.gpu.get)
    if big == "activations":
        ckpt = "" if t.activation_checkpointing else "set train.activation_checkpointing=true, "
        return (f"activations dominate: {ckpt}lower train.micro_batch_rows={t.micro_batch_rows} or train.row_tokens="
                f"{t.row_tokens}, or raise fsdp.cp_size={f.cp_size}")
    if big in ("params", "grads", "optimizer"):
        state = sum(plan.gpu[k] for k in ("params", "grads", "optimizer"))
        room = plan.capacity_gib * GIB - (plan.gpu_total - state)
        need = f"~{state / room:.0f}x more ranks sharding it" if room > 0 else "more ranks"
        return (f"sharded state dominates: set fsdp.offload=optimizer, or {need} "
                f"(raise fsdp.ep_size={f.ep_size} for experts, fsdp.dp_size={f.dp_size})")
    return "gathered layers dominate: raise fsdp.ep_size (fewer local experts per layer)"


def format_plan(plan: Plan, cfg) -> str:
    gib = lambda b: f"{b / GIB:9.2f} GiB"  # noqa: E731
    where = "GPU" if plan.capacity_gib else "rank"
    lines = [f"memory/{where}    {plan.layout}, {plan.tokens} tokens per rank and micro-batch"]
    lines += [f"  {k:<12}{gib(v)}  {where:<4}  {plan.notes[k]}" for k, v in plan.gpu.items()]
    lines += [f"  {k:<12}{gib(v)}  host  {plan.notes[k]}" for k, v in plan.host.items()]
    total = f"  {'total':<12}{gib(plan.gpu_total)}  {where:<4}"
    if plan.capacity_gib:
        verdict = "fits" if plan.fits else f"DOES NOT FIT: {advice(plan, cfg)}"
        total += f"  of {plan.capacity_gib:g} GiB (cluster.gpu_memory_gib): {verdict}"
    if plan.host:
        total += f"; host {sum(plan.host.values()) * (cfg.cluster.gpus_per_node or 1) / GIB:.1f} GiB per node"
    return "\n".join(lines + [total])


def dry_run_text(cfg) -> str:
    """The memory table for `molt dry_run=true`, or why there is none."""
    if not (Path(cfg.model.path) / "config.json").exists():
        return (f"memory        not planned: {cfg.model.path} has no config.json yet "
                "(the recipe builds it at the first run)")
    if is_vision(cfg.model.path):  # the plan reads a causal LM's shards: a vision-language run would crash on it
        return "memory        not planned: vision-language models are not planned yet"
    return format_plan(plan_memory(cfg), cfg)


def describe_model(cfg, hf: dict) -> str:
    f = model_facts(hf)
    kind = f"MoE {f.experts} experts, top-{f.top_k}" if f.experts else "dense"
    return (f"{cfg.model.name}: {hf.get('architectures', ['?'])[0]}, {hf['num_hidden_layers']} layers, hidden "
            f"{hf['hidden_size']}, head_dim {f.head_dim}, {kind} (exact parameter count: the memory plan below)")


def run_plan(cfg) -> str:
    """What a run would start, in a few lines, and its memory plan (`molt dry_run=true`, the run log)."""
    from molt.rollout.engine import server_cmd  # the launcher's own command line, not a copy

    f, r, t, e = cfg.fsdp, cfg.rollout, cfg.train, cfg.engine
    d = derived(cfg)
    device = f"{cfg.cluster.gpus_per_node} GPUs/node" if cfg.cluster.gpus_per_node else "cpu"
    env = "" if cfg.cluster.gpus_per_node else f"VLLM_CPU_KVCACHE_SPACE={e.kv_cache_gb} "
    source = f"built by recipe {cfg.model.build!r} if missing" if cfg.model.build else "existing directory"
    engines = [f"  engine {i}    {env}python "
               + shlex.join(server_cmd(e, cfg.model.path, e.base_port + i if e.base_port else "<free>",
                                       f"<0700 dir>/engine{i}.sock" if e.uds else "")[1:])
               for i in range(e.num_engines)]
    rollout = f"agent.mode={cfg.agent.mode} ({cfg.agent.module}), up to {r.max_inflight_groups} groups in flight"
    if t.replay_rollouts:  # molt/loop.py replay: the groups come from a dump
        engines, rollout = ["  engine      none"], f"none: the dumped steps of {t.replay_rollouts}, in order"
    lines = ["processes",
             "  driver      this process: the loop, advantages, weight sync, MLflow",
             *engines,
             f"  rollout     {rollout}",
             f"  actor       {d['world_size']} rank(s) on {device} x {cfg.cluster.num_nodes} node(s)",
             f"layout        dp {f.dp_size} x ep {f.ep_size} x cp {f.cp_size} = world size {d['world_size']}, "
             f"offload {f.offload}",
             f"model         {describe_model(cfg, hf_config(cfg.model))}",
             f"              {cfg.model.path} ({source})",
             f"estimator     {cfg.estimator.name}",
             f"batch         {t.groups_per_step} groups x {r.n} samples = {d['samples_per_step']} rollouts/step, "
             f"max_lag {r.max_lag}, temperature {r.temperature}",
             f"steps         {t.steps}, lr {t.lr}, eval every {cfg.eval.every or 'never'}, weight sync {e.sync}"]
    return "\n".join(lines + [dry_run_text(cfg)])
