"""Varlen attention for packed rows: causal SDPA over each packed segment alone, registered with transformers as
"molt_varlen" (the actor's CPU default, speed.fast_attention).

A packed row of T tokens holding segments of n_i tokens needs sum n_i^2 / 2 attention scores; "sdpa" gets a dense
(R, 1, T, T) block-diagonal mask from transformers and computes (and masks) all T^2 of them, in the math kernel on
CPU. At T = 2048 and ~80-token segments that is ~25x the work, and it was the largest cost of a CPU train step
(experiments/benchmarks/cpu_step.py). Segment starts are the position resets (pack.py), read from the position_ids
transformers hands every attention call. The name has no mask function, so transformers builds no mask at all and
drops a 2-D padding mask: rows must be packed (right padding only, as pack.py does), never left-padded.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

NAME = "molt_varlen"


def segment_bounds(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """(R, T) positions restarting at 0 for each packed segment -> per row, the [start, end) of each segment."""
    width = position_ids.shape[-1]
    rows = [(r == 0).nonzero().flatten().tolist() + [width] for r in position_ids.cpu()]
    return [[(a, b) for a, b in zip(starts, starts[1:])] for starts in rows]


def varlen_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                     dropout: float = 0.0, scaling: float | None = None, position_ids: torch.Tensor | None = None,
                     sliding_window: int | None = None, **kwargs):
    """transformers attention interface: query (R, Hq, T, D), key/value (R, Hkv, T, D) -> (R, T, Hq, Dv)."""
    if position_ids is None or sliding_window is not None:
        raise ValueError(f"attention {NAME!r} needs position_ids and no sliding window: use attn_implementation='sdpa'")
    bounds = segment_bounds(position_ids.expand(query.shape[0], -1))
    gqa = query.shape[1] != key.shape[1]
    rows = [torch.cat([F.scaled_dot_product_attention(query[r:r + 1, :, a:b], key[r:r + 1, :, a:b],
                                                      value[r:r + 1, :, a:b], dropout_p=dropout, is_causal=True,
                                                      scale=scaling, enable_gqa=gqa)
                       for a, b in row], 2) for r, row in enumerate(bounds)]  # (1, Hq, T, Dv) each
    return torch.cat(rows).transpose(1, 2).contiguous(), None  # (R, T, Hq, Dv)


AttentionInterface.register(NAME, varlen_attention)
