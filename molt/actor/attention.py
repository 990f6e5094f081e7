"""Varlen attention for packed rows: causal SDPA over each packed segment alone, registered with transformers as
"molt_varlen" (the actor's CPU default, speed.fast_attention).

A packed row of T tokens holding segments of n_i tokens needs sum n_i^2 / 2 attention scores; "sdpa" gets a dense
(R, 1, T, T) block-diagonal mask from transformers and computes (and masks) all T^2 of them, in the math kernel on
CPU. At T = 2048 and ~80-token segments that is ~25x the work, and it was the largest cost of a CPU train step
(experiments/benchmarks/cpu_step.py). Segment starts are the position resets (pack.py), read from the position_ids
transformers hands every attention call. The name has no mask function, so transformers builds no mask at all and
drops a 2-D padding mask: rows must be packed (right padding only, as pack.py does), never left-padded. It is
also the one implementation that reads shared prompts (pack.py, `share`) from the positions.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

NAME = "molt_varlen"


def blocks(position_ids: torch.Tensor) -> list[list[tuple[int, int, int, int]]]:
    """(R, T) positions -> per row, (start, end, root, k) of each run of positions that go up by one. A run from
    position 0 is a segment's start (root = start, k = 0); a run from k > 0 continues a shared prefix (pack.py): it
    attends to columns root..root+k-1 of the last run from 0, then causally to itself."""
    out = []
    for r in position_ids.cpu():
        pos = r.tolist()
        starts = [0] + ((r[1:] - r[:-1]) != 1).nonzero().flatten().add(1).tolist() + [len(pos)]
        row, root = [], 0
        for a, b in zip(starts, starts[1:]):
            root = a if pos[a] == 0 else root
            row.append((a, b, root, pos[a]))
        out.append(row)
    return out


MASK_ELEMENTS = 1 << 24  # per call on shared prefixes: runs x longest x (prefix + longest), bounds mask and scores


def _batches(runs: list[tuple[int, int]], p: int) -> list[list[tuple[int, int]]]:
    """The runs on one shared prefix of p tokens in batches whose padded mask stays within MASK_ELEMENTS."""
    out, batch = [], []
    for a, b in runs:
        n = max([b - a] + [y - x for x, y in batch])
        if batch and (len(batch) + 1) * n * (p + n) > MASK_ELEMENTS:
            out.append(batch)
            batch = []
        batch.append((a, b))
    return out + [batch]


def _shared(q, k, v, root: int, p: int, runs: list[tuple[int, int]], **kw) -> tuple[torch.Tensor, list[int]]:
    """Runs that continue the p keys from `root`, in one call, each padded to the longest (masked off): their
    outputs (1, Hq, tokens, Dv) and columns."""
    n = max(b - a for a, b in runs)
    idx = torch.tensor([[min(a + j, b - 1) for j in range(n)] for a, b in runs], device=q.device)  # (m, n)
    real = torch.tensor([[j < b - a for j in range(n)] for a, b in runs], device=q.device)  # (m, n)
    prefix = lambda x: x[:, :, root:root + p].expand(len(runs), -1, -1, -1)  # noqa: E731  (m, H, p, D)
    qs, ks, vs = (x[0][:, idx].transpose(0, 1) for x in (q, k, v))  # (m, H, n, D) each
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril() & real[:, None, :]  # (m, n, n)
    mask = torch.cat([real.new_ones(len(runs), n, p), causal], 2)[:, None]  # (m, 1, n, p + n): all the prefix
    out = F.scaled_dot_product_attention(qs, torch.cat([prefix(k), ks], 2), torch.cat([prefix(v), vs], 2),
                                         attn_mask=mask, **kw)  # (m, Hq, n, Dv)
    return out.transpose(0, 1)[:, real][None], idx[real].tolist()


def _row(q, k, v, row: list[tuple[int, int, int, int]], **kw) -> torch.Tensor:
    """One row's attention, (1, Hq, T, Dv) from q (1, Hq, T, D), k and v (1, Hkv, T, D): each run from 0 alone and
    causal; the runs that continue one shared prefix in batches (_shared)."""
    parts, cols, shared = [], [], {}
    for a, b, root, p in row:
        if p == 0:
            parts.append(F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, **kw))
            cols += range(a, b)
        else:
            shared.setdefault((root, p), []).append((a, b))
    if not shared:  # the runs in column order already
        return torch.cat(parts, 2)
    for (root, p), runs in shared.items():
        for batch in _batches(runs, p):
            out, where = _shared(q, k, v, root, p, batch, **kw)
            parts.append(out)
            cols += where
    return torch.cat(parts, 2)[:, :, torch.tensor(cols, device=q.device).argsort()]  # back in column order


def varlen_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                     dropout: float = 0.0, scaling: float | None = None, position_ids: torch.Tensor | None = None,
                     sliding_window: int | None = None, **kwargs):
    """transformers attention interface: query (R, Hq, T, D), key/value (R, Hkv, T, D) -> (R, T, Hq, Dv)."""
    if position_ids is None or sliding_window is not None:
        raise ValueError(f"attention {NAME!r} needs position_ids and no sliding window: use attn_implementation='sdpa'")
    kw = dict(dropout_p=dropout, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    rows = [_row(query[r:r + 1], key[r:r + 1], value[r:r + 1], row, **kw)
            for r, row in enumerate(blocks(position_ids.expand(query.shape[0], -1)))]  # (1, Hq, T, Dv) each
    return torch.cat(rows).transpose(1, 2).contiguous(), None  # (R, T, Hq, Dv)


AttentionInterface.register(NAME, varlen_attention)
