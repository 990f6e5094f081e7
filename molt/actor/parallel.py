"""The actor's parallel layout on plain torch: one DeviceMesh (dp, ep, cp), expert parallelism, FSDP2.

    mesh = build_mesh(cfg.fsdp, "cuda")            # world size = dp * ep * cp
    parallelize(model, mesh, cfg.fsdp, checkpointing=True, mixed_precision=True)   # on a meta-device model
    loading.materialize(model, model_dir, "cuda")  # each rank reads its own shards (molt/actor/loading.py)

Data: every (dp, ep) coordinate is its own data shard (EP ranks see different tokens, as DP ranks do);
the cp ranks of one (dp, ep) coordinate share its packed rows, each holding a slice of every row.
Gradients are SUMMED over ranks: the loss is already divided by the whole batch's loss-token count.
The model code is never edited: expert modules get an instance-level forward, FSDP2 wraps modules.
"""
from __future__ import annotations

import functools
import types

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.tensor import DTensor, Shard

from molt.actor import speed
from molt.actor.pack import COLUMNS, micro_batches
from molt.actor.replay import install as install_replay
from molt.types import Batch

AXES = ("dp", "ep", "cp")  # the one place the mesh axis names live
DENSE = AXES  # the axes that shard dense parameters (every rank), flattened to one
EXPERT = ("dp", "cp")  # the axes that shard expert parameters (the ranks of one ep coordinate)


def build_mesh(fsdp, device_type: str) -> DeviceMesh:
    """The (dp, ep, cp) mesh over the initialised default process group."""
    shape = (fsdp.dp_size, fsdp.ep_size, fsdp.cp_size)
    assert dist.get_world_size() == shape[0] * shape[1] * shape[2], \
        f"world size {dist.get_world_size()} != fsdp.dp_size*ep_size*cp_size = {shape}"
    return init_device_mesh(device_type, shape, mesh_dim_names=AXES)


def flat(mesh: DeviceMesh, axes: tuple[str, ...]) -> DeviceMesh:
    """The 1-D mesh over `axes` (fully_shard takes 1-D meshes); torch caches it on the root mesh by name."""
    return mesh[axes]._flatten("_".join(axes))


def data_shard(mesh: DeviceMesh) -> tuple[int, int]:
    """(index, count) of this rank's data shard: (dp, ep) coordinates, row-major; cp ranks share one."""
    ep = mesh["ep"].size()
    return mesh["dp"].get_local_rank() * ep + mesh["ep"].get_local_rank(), mesh["dp"].size() * ep


def expert_modules(model) -> list[torch.nn.Module]:
    """transformers' fused MoE experts (Qwen3-MoE, DeepSeek-V3, ...): 3-D gate_up_proj (E, 2I, H), down_proj (E, H, I)."""
    return [m for m in model.modules()
            if hasattr(m, "num_experts") and getattr(m, "gate_up_proj", None) is not None
            and getattr(m, "down_proj", None) is not None and m.gate_up_proj.ndim == 3]


def parallelize(model, mesh: DeviceMesh | None, fsdp=None, *, checkpointing: bool = False, compile_head=None,
                replay: bool = False, mixed_precision: bool = False):
    """Apply the layout in this fixed order; each step only needs the ones before it. Without a mesh (one process)
    only steps 1-3 apply. Works on a meta-device model (loading.materialize fills the shards afterwards)."""
    # 1. Activation checkpointing: wraps each decoder layer's forward; FSDP2 (step 6) then wraps the checkpointed layers.
    if checkpointing:
        speed.checkpoint_layers(model)
    # 2. torch.compile the (checkpointed) layer forwards, so the recompute is compiled too, and the log-prob head.
    if compile_head is not None:
        speed.compile_model(model, compile_head)
    # 3. Routing replay: MoE routers take the engine's recorded experts; the gates see local tokens, so EP/CP below
    #    are indifferent to it.
    if replay:
        install_replay(model)
    if mesh is None:
        return model
    # 4. Expert parallelism: it slices the expert weights, so FSDP below shards only the local experts.
    if mesh["ep"].size() > 1:
        if not expert_modules(model):
            raise ValueError(f"fsdp.ep_size={mesh['ep'].size()} but {type(model).__name__} has no fused experts module "
                             "(3-D gate_up_proj/down_proj, as Qwen3-MoE and DeepSeek-V3): set fsdp.ep_size=1")
        for experts in expert_modules(model):
            shard_experts(experts, mesh["ep"])
    # 5. Context parallelism: swaps attention for an exact CP attention; no parameters change.
    if mesh["cp"].size() > 1:
        from molt.actor import context

        context.enable(model, mesh["cp"])
    # 6. FSDP2 last: it wraps the modules (and their parameters) that the steps above produced.
    apply_fsdp(model, mesh, mixed_precision, fsdp.offload == "optimizer")
    return model


# ---- expert parallelism ---------------------------------------------------------------------------------------

def shard_experts(experts: torch.nn.Module, group_mesh: DeviceMesh) -> None:
    """Keep this ep rank's E/ep experts and route tokens to their owners in forward (instance-level)."""
    ep, rank, total = group_mesh.size(), group_mesh.get_local_rank(), experts.num_experts
    assert total % ep == 0, f"fsdp.ep_size={ep} does not divide {total} experts"
    local = total // ep
    for name in ("gate_up_proj", "down_proj"):
        full = getattr(experts, name)
        setattr(experts, name, torch.nn.Parameter(full.data[rank * local:(rank + 1) * local].clone(),
                                                  requires_grad=full.requires_grad))
    experts.num_experts = local  # the class forward now computes the local experts only
    experts.ep_group, experts.ep_total, experts.ep_rank = group_mesh.get_group(), total, rank
    experts.local_forward = types.MethodType(type(experts).forward, experts)
    experts.forward = types.MethodType(ep_forward, experts)


def _exchange_counts(send: torch.Tensor, group) -> torch.Tensor:
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


def _all_to_all(x: torch.Tensor, out_sizes: list[int], in_sizes: list[int], group) -> torch.Tensor:
    """Rows of x to the group's ranks (in_sizes[r] rows to rank r), with autograd (backward: the reverse exchange)."""
    return wait_tensor(all_to_all_single_autograd(x.contiguous(), out_sizes, in_sizes, group))


def ep_forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """All-to-all each (token, chosen expert) pair to the rank owning the expert, compute, all-to-all back,
    then sum over the k choices weighted by the router here (router gradients stay local).

    Gotcha: every rank must join every all-to-all, forward and backward, even with no tokens to send or
    receive; so the received block is always wired into the graph (see the empty case)."""
    n, k = top_k_index.shape
    ep, local, group = self.ep_group.size(), self.num_experts, self.ep_group
    flat = top_k_index.reshape(-1)  # (N*K,) global expert ids
    order = flat.argsort(stable=True)  # pairs grouped by expert, hence by owning rank
    send = torch.bincount(flat // local, minlength=ep)  # (ep,) pairs per destination rank
    recv = _exchange_counts(send, group)  # (ep,) pairs per source rank
    send_sizes, recv_sizes = send.tolist(), recv.tolist()
    ids = torch.empty(sum(recv_sizes), dtype=flat.dtype, device=flat.device)
    dist.all_to_all_single(ids, flat[order] % local, recv_sizes, send_sizes, group=group)  # (M,) local expert ids
    x = _all_to_all(hidden[order // k], recv_sizes, send_sizes, group)  # (M, H)
    if x.shape[0]:
        y = self.local_forward(x, ids[:, None], torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device))  # (M, H)
    else:  # nothing to compute: still give the experts a (zero) gradient so FSDP reduces the same tensors
        y = x + 0 * (self.gate_up_proj.sum() + self.down_proj.sum())  # (0, H)
    back = _all_to_all(y, send_sizes, recv_sizes, group)  # (N*K, H) in `order`
    pairs = torch.empty_like(back).index_copy(0, order, back).view(n, k, -1)  # (N, K, H) in token order
    return (pairs * top_k_weights[..., None].to(pairs.dtype)).sum(1).to(hidden.dtype)  # (N, H)


# ---- FSDP2 ----------------------------------------------------------------------------------------------------

def apply_fsdp(model, mesh: DeviceMesh, mixed_precision: bool, offload: bool) -> None:
    """fully_shard each decoder layer, then the root (embeddings, final norm, head). Under expert parallelism the
    expert weights are sharded over dp x cp only (their ep copies are different experts, not replicas), as a group
    of their own; at ep 1 that is the layer's group, and the experts shard with their layer: a separate group inside
    a compiled layer costs FSDP hooks and two graph breaks per layer (train.compile)."""
    kw = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if mixed_precision else MixedPrecisionPolicy(),
              # offload: sharded fp32 params, grads and AdamW state stay on the host; the step runs there
              offload_policy=CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload else OffloadPolicy())
    decoder, dense, expert = model.get_decoder(), flat(mesh, DENSE), flat(mesh, EXPERT)
    for layer in decoder.layers:
        for experts in expert_modules(layer) if mesh["ep"].size() > 1 else ():
            # shard dim 1 (2I / H), not the expert dim: with one expert per ep rank, dim 0 cannot split over dp
            sum_gradients(fully_shard(experts, mesh=expert, shard_placement_fn=lambda p: Shard(1), **kw), expert)
        sum_gradients(fully_shard(layer, mesh=dense, **kw), dense)
    sum_gradients(fully_shard(model, mesh=dense, **kw), dense)  # the root: embeddings, final norm, head
    model.get_decoder = types.MethodType(functools.partial(_decoder_through_root, decoder=decoder), model)


def _decoder_through_root(model, decoder):
    """Instance-level get_decoder() for an FSDP model. The actor runs the decoder, then the head chunk by chunk
    (never full-vocabulary logits); but FSDP gathers the root's parameters (embeddings, norm, head) and
    schedules their gradient reduction only when the ROOT module is called. So "the decoder" becomes the root's
    forward with no logits kept (an empty index list), returning the inner decoder's last hidden state, taken by a
    forward hook. Gotcha: not through output_hidden_states=True, which makes transformers hook every layer's
    submodules with a ContextVar read that breaks each compiled layer's graph (train.compile)."""
    def run(**kwargs):
        seen = []
        hook = decoder.register_forward_hook(lambda module, args, out: seen.append(out.last_hidden_state))
        try:
            model(**kwargs, logits_to_keep=torch.zeros(0, dtype=torch.long))
        finally:
            hook.remove()
        return types.SimpleNamespace(last_hidden_state=seen[-1])  # (R, T, H), after the final norm
    return run


def sum_gradients(module, group: DeviceMesh) -> None:
    """FSDP2 averages over its ranks by default; the loss is normalised by the global token count already. A group
    of one rank averages nothing, and FSDP2 then skips the division, which a factor of 1.0 would not (one more
    pass over every fp32 gradient)."""
    if group.size() > 1:
        module.set_gradient_divide_factor(1.0)
    if hasattr(module, "set_force_sum_reduction_for_comms"):  # plain SUM (gloo has no PREMUL_SUM)
        module.set_force_sum_reduction_for_comms(True)


# ---- full tensors and norms -----------------------------------------------------------------------------------

def full_tensors(model, grads: bool = False, head: bool = False, only: set[str] | None = None,
                 dtype: torch.dtype = torch.float32, device="cpu") -> dict[str, torch.Tensor]:
    """Unsharded copies (CPU fp32 by default) of the state dict (or every parameter's gradient), `only` these names
    if given; with a mesh a collective (every rank calls it, in the same order), without one a plain copy. Expert
    weights are concatenated back over the ep axis. head=True adds `lm_head.weight` when tied embeddings leave it
    out of the state dict (engines reloading weights need it)."""
    owners = {f"{prefix}.{n}": m for prefix, m in model.named_modules() if hasattr(m, "ep_group")
              for n in ("gate_up_proj", "down_proj")}
    out = {}
    for name, p in model.named_parameters() if grads else model.state_dict().items():
        t = p.grad if grads else p
        if t is None or (only is not None and name not in only):
            continue
        t = t.full_tensor() if isinstance(t, DTensor) else t
        if name in owners:
            group = owners[name].ep_group
            parts = [torch.empty_like(t) for _ in range(group.size())]
            dist.all_gather(parts, t.contiguous(), group=group)
            t = torch.cat(parts)
        out[name] = t.detach().to(device, dtype, copy=True).contiguous()
    if head and "lm_head.weight" not in out and model.get_output_embeddings() is not None:
        tied = next(n for n, m in model.named_modules() if m is model.get_input_embeddings())
        out["lm_head.weight"] = out[f"{tied}.weight"]
    return out


def local_grads(params) -> list[torch.Tensor]:
    """This rank's part of every gradient (DTensor shards as their local tensors, which alias them)."""
    return [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]


def grad_norm(params, device) -> torch.Tensor:
    """Global L2 norm of sharded gradients: each element lives on exactly one rank (dense params are sharded over
    all ranks, each ep rank holds different experts), so local squared norms sum to the total. Foreach kernels:
    one launch per device and dtype, not a few per parameter."""
    sq = torch.nn.utils.get_total_norm(local_grads(params), foreach=True).to(device=device, dtype=torch.float32) ** 2
    dist.all_reduce(sq)
    return sq.sqrt()


# ---- data layout ----------------------------------------------------------------------------------------------

def padding_batch(like: Batch, width: int) -> Batch:
    """One row of `width` padding tokens (segment -1, loss mask 0): a micro-batch that trains on nothing but still
    joins every collective (FSDP all-gathers, EP all-to-alls) that the other ranks' micro-batches run."""
    fill = {k: f for k, (f, _) in COLUMNS.items()}
    pad = like.map(lambda k, x: torch.full((1, width, *x.shape[2:]), fill.get(k, 0), dtype=x.dtype))
    pad.position_ids = torch.arange(width)[None]  # (1, width)
    return pad


def shard_micro_batches(batch: Batch, mesh: DeviceMesh, rows: int) -> list[Batch]:
    """This rank's micro-batches: data shard s of S takes rows s, s+S, ... of the (identical on every rank) packed
    batch; every rank returns the same count, topped up with padding micro-batches."""
    shard, shards = data_shard(mesh)
    mine = torch.arange(shard, batch.num_rows, shards)
    out = micro_batches(batch.map(lambda _, x: x[mine]), rows) if len(mine) else []
    count = -(-(-(-batch.num_rows // shards)) // rows)  # ceil(ceil(R / S) / rows), the same on every rank
    return out + [padding_batch(batch, 2 * mesh["cp"].size())] * (count - len(out))


def reduce_metrics(totals: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """Sum metrics over all ranks (each is a sum over its tokens / global count), min/max for _min/_max keys."""
    keys = sorted(totals)
    ops = {k: dist.ReduceOp.MAX if k.endswith("_max") else dist.ReduceOp.MIN if k.endswith("_min")
           else dist.ReduceOp.SUM for k in keys}
    out = {}
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN):
        ks = [k for k in keys if ops[k] == op]
        if ks:
            v = torch.stack([totals[k].float().to(device) for k in ks])  # NCCL reduces device tensors only
            dist.all_reduce(v, op=op)
            out |= dict(zip(ks, v.cpu()))
    return out
