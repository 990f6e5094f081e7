"""Sequence packing: segments -> rows of at most `train.row_tokens` tokens (a `Batch`).

Rows are filled first-fit decreasing. Positions restart at 0 for each segment; transformers
turns a position reset into a block-diagonal causal mask (`find_packed_sequence_indices` in
`transformers.masking_utils`, used by sdpa, eager and flash attention alike), provided the
model is called with no 2-D attention mask and no KV cache. Padding at the end of a row is
one more "segment" (positions 0..k, segment -1), so it never attends into real tokens.
"""
from __future__ import annotations

from dataclasses import fields, replace

import torch

from molt.types import Batch, Segment

PAD_ID = 0  # any valid id: padding is never attended to by real tokens and never trained on


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of segment indices, longest segments first, each into the first row it fits."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = next((r for r, f in enumerate(free) if f >= lengths[i]), len(rows))
        if r == len(rows):
            rows.append([])
            free.append(capacity)
        rows[r].append(i)
        free[r] -= lengths[i]
    return rows


# Batch column -> (padding value, dtype)
COLUMNS = {"input_ids": (PAD_ID, torch.long), "position_ids": (0, torch.long), "segment_ids": (-1, torch.long),
           "loss_mask": (0, torch.float32), "behaviour_logp": (0, torch.float32), "advantages": (0, torch.float32)}


def _check(segments: list[Segment], advantages: list, row_tokens: int) -> None:
    assert len(advantages) == len(segments), f"{len(advantages)} advantage lists for {len(segments)} segments"
    for i, s in enumerate(segments):
        s.check()
        n = len(s.token_ids)
        if n > row_tokens:
            raise ValueError(f"segment {i} has {n} tokens > train.row_tokens={row_tokens}: raise train.row_tokens "
                             f"to at least {n} or lower the agent's token budget (agent.max_total_tokens)")
        assert n > 0, f"segment {i} is empty"
        assert s.loss_mask[0] == 0, f"segment {i} starts with a generated token: nothing precedes it to predict it"
        a = torch.as_tensor(advantages[i])
        assert a.ndim == 0 or a.shape == (n,), f"segment {i}: {tuple(a.shape)} advantages for {n} tokens"


def _columns(i: int, s: Segment, advantage) -> dict[str, torch.Tensor]:
    """One segment's tokens as Batch columns, each (n,); advantages and behaviour log-probs zeroed off the mask."""
    n, mask = len(s.token_ids), torch.tensor(s.loss_mask, dtype=torch.float32)
    return {"input_ids": torch.tensor(s.token_ids), "position_ids": torch.arange(n), "segment_ids": torch.full((n,), i),
            "loss_mask": mask, "behaviour_logp": torch.tensor(s.logprobs, dtype=torch.float32) * mask,
            "advantages": torch.as_tensor(advantage, dtype=torch.float32) * mask}


def pack(segments: list[Segment], advantages: list[list[float] | float], row_tokens: int) -> Batch:
    """Pack segments into one Batch of rows; advantages[i] is per token of segments[i] (or one float for all)."""
    _check(segments, advantages, row_tokens)
    rows = first_fit_decreasing([len(s.token_ids) for s in segments], row_tokens)
    width = max(sum(len(segments[i].token_ids) for i in row) for row in rows)
    cols = {k: torch.full((len(rows), width), fill, dtype=dtype) for k, (fill, dtype) in COLUMNS.items()}
    spans = [(0, 0, 0)] * len(segments)
    for r, row in enumerate(rows):
        start = 0
        for i in row:
            n = len(segments[i].token_ids)
            for k, v in _columns(i, segments[i], advantages[i]).items():
                cols[k][r, start:start + n] = v
            spans[i], start = (r, start, n), start + n
        cols["position_ids"][r, start:] = torch.arange(width - start)  # padding: its own segment
    return Batch(spans=spans, **cols)


def micro_batches(batch: Batch, rows: int) -> list[Batch]:
    """Split into batches of `rows` rows, each trimmed to its longest row (less padding to compute).

    Segment ids still index the full segment list; `spans` stay with the full batch only.
    """
    out = []
    for a in range(0, batch.num_rows, rows):
        b = min(a + rows, batch.num_rows)
        width = int((batch.segment_ids[a:b] >= 0).sum(1).max())  # real tokens are left-aligned in each row
        cut = {f.name: getattr(batch, f.name)[a:b, :width] for f in fields(batch)
               if isinstance(getattr(batch, f.name), torch.Tensor)}
        out.append(replace(batch, spans=[], **cut))
    return out


def to_device(batch: Batch, device) -> Batch:
    moved = {f.name: getattr(batch, f.name).to(device) for f in fields(batch)
             if isinstance(getattr(batch, f.name), torch.Tensor)}
    return replace(batch, **moved)
