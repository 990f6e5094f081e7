"""Context parallelism: each rank of the `cp` mesh axis holds a load-balanced slice of every packed row, and
attention stays exact. Each layer all-gathers keys and values over the cp group and attends its local queries to
all of them under a mask that is causal in global column order AND block-diagonal over packed segments.

    context.enable(model, mesh["cp"])                          # parallelize() does this, before FSDP
    mb, columns = pack.cp_slice(pack.align_next(mb), cp, cp_rank)
    logp = token_logprobs(model, mb)                           # adds forward_kwargs(model, mb): the mask

Everything else in a transformer is per token (norms, MLP, router, RoPE from the slice's own position ids), so
only attention needs the other ranks. The mask reaches the attention function through the forward's kwargs
(transformers hands unknown kwargs down to it), not through a global, so activation-checkpoint recomputation
in backward sees the same one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface

from molt.actor.pack import cp_columns, cp_unslice

NAME = "molt_cp"  # the attention implementation registered with transformers


@dataclass
class CpView:
    """What one forward's attention needs: the cp group and the mask of its local queries over all keys."""

    group: dist.ProcessGroup
    mask: torch.Tensor  # (R, 1, T/cp, T) bool, True = attend; keys in gathered (rank-major) order


def _gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Concatenate every rank's x along `dim`, in rank order (no autograd)."""
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] * dist.get_world_size(group), *x.shape[1:]))
    dist.all_gather_into_tensor(out, x, group=group)
    return out.movedim(0, dim)


class _GatherSequence(torch.autograd.Function):
    """All-gather of (R, H, T', D) keys or values along the sequence. Every rank's queries used every rank's keys,
    so the gradient of this rank's slice is the SUM over ranks of their output gradients at its columns: a
    reduce-scatter (all-reduce then slice where the backend lacks it, as gloo does)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _gather(x, group, 2)  # (R, H, T, D)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group, rank = ctx.group, dist.get_rank(ctx.group)
        g = grad.movedim(2, 0).contiguous()  # (T, R, H, D)
        if dist.get_backend(group) == "nccl":
            out = g.new_empty((g.shape[0] // dist.get_world_size(group), *g.shape[1:]))
            dist.reduce_scatter_tensor(out, g, group=group)
        else:
            dist.all_reduce(g, group=group)
            out = g.chunk(dist.get_world_size(group))[rank]
        return out.movedim(0, 2), None


def cp_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                 scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
                 molt_cp: CpView | None = None, **kwargs):
    """transformers attention interface: query (R, Hq, T', D), key/value (R, Hkv, T', D) -> (R, T', Hq, Dv)."""
    if molt_cp is None:
        raise RuntimeError("a context-parallel model was called without its mask: forward it through "
                           "actor.token_logprobs, which passes context.forward_kwargs(model, batch)")
    if sliding_window is not None:
        raise ValueError("context parallelism does not support sliding-window attention: set fsdp.cp_size=1")
    # gather the Hkv heads, then repeat them for the query heads of their group (GQA) by hand: sdpa's enable_gqa
    # is not served by the memory-efficient CUDA kernel, the only fused one taking an arbitrary mask
    rep = query.shape[1] // key.shape[1]
    key = _GatherSequence.apply(key, molt_cp.group).repeat_interleave(rep, 1)  # (R, Hq, T, D)
    value = _GatherSequence.apply(value, molt_cp.group).repeat_interleave(rep, 1)  # (R, Hq, T, Dv)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=molt_cp.mask, dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous(), None  # (R, T', Hq, Dv)


def attention_mask(segment_ids: torch.Tensor, group) -> torch.Tensor:
    """(R, T') local segment ids -> (R, 1, T', T) mask over the gathered keys: key column <= query column (global
    order) and same segment. Padding (segment -1) attends only to padding, and every query to itself (no empty row)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    width = segment_ids.shape[1] * cp
    keys = _gather(segment_ids, group, 1)  # (R, T) segment of each gathered key
    q_col = cp_columns(width, cp, rank).to(segment_ids.device)  # (T',)
    k_col = torch.cat([cp_columns(width, cp, r) for r in range(cp)]).to(segment_ids.device)  # (T,)
    causal = k_col[None, :] <= q_col[:, None]  # (T', T)
    same = segment_ids[:, :, None] == keys[:, None, :]  # (R, T', T)
    return (causal & same)[:, None]


def enable(model, cp_mesh) -> None:
    """Switch `model` (a transformers model; also a frozen reference) to exact CP attention over the 1-D mesh."""
    if cp_mesh.size() == 1:
        return
    AttentionInterface.register(NAME, cp_attention)
    model.set_attn_implementation(NAME)  # transformers then builds no mask of its own (NAME has no mask function)
    model.molt_cp_group = cp_mesh.get_group()


def forward_kwargs(model, batch) -> dict:
    """Extra kwargs for the decoder's forward: the CP mask of this micro-batch ({} without CP). A collective."""
    group = getattr(model, "molt_cp_group", None)
    if group is None:
        return {}
    assert batch.targets is not None, "a context-parallel model takes pack.cp_slice(pack.align_next(mb), ...) rows"
    return {"molt_cp": CpView(group, attention_mask(batch.segment_ids, group))}


def gather_columns(x: torch.Tensor, group, width: int) -> torch.Tensor:
    """(R, T', ...) per-token values of this rank's slice -> (R, width, ...) of the whole rows, on every rank."""
    return cp_unslice(list(_gather(x, group, 1).chunk(dist.get_world_size(group), 1)), width)
