"""Sequence packing: segments -> rows of at most `train.row_tokens` tokens (a `Batch`).

Rows are filled first-fit decreasing. Positions restart at 0 for each segment; transformers
turns a position reset into a block-diagonal causal mask (`find_packed_sequence_indices` in
`transformers.masking_utils`, used by sdpa, eager and flash attention alike), provided the
model is called with no 2-D attention mask and no KV cache. Padding at the end of a row is
one more "segment" (positions 0..k, segment -1), so it never attends into real tokens.

Shared prefixes (`share=True`, the train step's packing): segments whose prompts (every token before the first
generated one) begin alike put the common part in a row once: a group's equal prompts, or an agent CLI's prompts that
part at a scratch path (`shared_units`). Of a common prefix of k tokens (at most a prompt's length less one) the k come
once (positions 0..k-1), then each member's tokens from k on (positions k..n-1): every member keeps at least its
prompt's last token, so each generated token is still predicted from the column before it. A run of positions
that starts at k > 0 attends to the first k columns of the last run that started at 0 (molt/actor/attention.py), so
each token sees exactly the tokens it saw unshared. Only molt_varlen reads positions this way; transformers' own
masks would cut each member off its prompt.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from molt.types import Batch, Segment

PAD_ID = 0  # any valid id: padding is never attended to by real tokens and never trained on


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of segment indices, longest segments first, each into the first row it fits."""
    rows, free = [], []  # segment indices, tokens left (per row)
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
           "loss_mask": (0, torch.float32), "behaviour_logp": (0, torch.float32), "advantages": (0, torch.float32),
           # (R, T, layers, top_k), only when some segment carries routes; -1: the router keeps its own top-k
           "routed_experts": (-1, torch.int32)}


def _trailing_dims(segments: list[Segment]) -> dict[str, tuple]:
    """Columns to build and their dims after (R, T): routed experts only when some segment has them."""
    routed = {tuple(s.routed_experts.shape[1:]) for s in segments if s.routed_experts is not None}
    assert len(routed) <= 1, f"segments routed with different (layers, top_k): {routed}"
    return {k: () for k in COLUMNS if k != "routed_experts"} | {"routed_experts": d for d in routed}


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
        routed = n if s.routed_experts is None else len(s.routed_experts)
        assert routed == n, f"segment {i}: routes for {routed} of {n} tokens (Segment.attach_routes after each engine call)"
        a = torch.as_tensor(advantages[i])
        assert a.ndim == 0 or a.shape == (n,), f"segment {i}: {tuple(a.shape)} advantages for {n} tokens"


def _columns(segments: list[Segment], advantages: list) -> dict[str, torch.Tensor]:
    """Every segment's tokens end to end as Batch columns, each (sum of n,), one tensor per column (one set per
    segment took 2.7 ms of a quickstart step's 64); advantages and behaviour log-probs zeroed off the mask."""
    flat = {"input_ids": [], "position_ids": [], "segment_ids": [], "loss_mask": [], "behaviour_logp": [],
            "advantages": []}
    for i, (s, a) in enumerate(zip(segments, advantages)):
        n, a = len(s.token_ids), torch.as_tensor(a, dtype=torch.float32)
        for k, v in (("input_ids", s.token_ids), ("position_ids", range(n)), ("segment_ids", [i] * n),
                     ("loss_mask", s.loss_mask), ("behaviour_logp", s.logprobs),
                     ("advantages", [a.item()] * n if a.ndim == 0 else a.tolist())):
            flat[k].extend(v)
    cols = {k: torch.tensor(v, dtype=COLUMNS[k][1]) for k, v in flat.items()}
    for k in ("behaviour_logp", "advantages"):
        cols[k] *= cols["loss_mask"]
    return cols


def shared_units(segments: list[Segment], row_tokens: int) -> list[tuple[int, list[int]]]:
    """(k, members): units that go into a row whole; the members' first k tokens are equal and packed once (k = 0:
    a segment alone). In the sorted order of their prompts, a segment joins the unit before it when their common
    prefix is at least half its prompt, the unit saves no fewer tokens with it (k times the members but one), and the
    unit still fits a row; every member keeps at least its prompt's last token. So a group's equal prompts share all
    but that token, and prompts that part midway (an agent CLI's scratch path) share up to where they part. Segments
    with routes or images are never shared (their prompts' routes and pixels stay per segment)."""
    prompts = {}  # of the segments that may share: every token before the first generated one, at least two
    for i, s in enumerate(segments):
        q = s.loss_mask.index(1) if 1 in s.loss_mask else 0
        if q >= 2 and s.routed_experts is None and not s.images:
            prompts[i] = s.token_ids[:q]
    units = [(0, [i]) for i in range(len(segments)) if i not in prompts]
    k, unit, size = 0, [], 0
    for i in sorted(prompts, key=prompts.get):
        p, n = prompts[i], len(segments[i].token_ids)
        if unit:
            head = prompts[unit[0]]
            common = next((j for j, (a, b) in enumerate(zip(head[:k], p)) if a != b), min(k, len(p) - 1))
            grown = size + (len(unit) - 1) * (k - common) + n - common  # the unit's tokens with i, sharing `common`
            if 2 * common >= len(p) and common * len(unit) >= k * (len(unit) - 1) and grown <= row_tokens:
                k, unit, size = common, unit + [i], grown
                continue
            units.append((k, unit))
        k, unit, size = len(p) - 1, [i], n
    units += [(k, unit)] if unit else []
    return [(k if len(unit) > 1 else 0, unit) for k, unit in units]  # one member alone shares nothing


def pack(segments: list[Segment], advantages: list[list[float] | float], row_tokens: int, share: bool = False) -> Batch:
    """Pack segments into one Batch of rows; advantages[i] is per token of segments[i] (or one float for all).
    share: equal prompts once per row (the module docstring); `spans` then hold each member's own tokens only."""
    _check(segments, advantages, row_tokens)
    units = shared_units(segments, row_tokens) if share else [(0, [i]) for i in range(len(segments))]
    sizes = [k + sum(len(segments[i].token_ids) - k for i in members) for k, members in units]
    rows = first_fit_decreasing(sizes, row_tokens)
    width = max(sum(sizes[u] for u in row) for row in rows)
    cols = {k: torch.full((len(rows), width, *dims), COLUMNS[k][0], dtype=COLUMNS[k][1])
            for k, dims in _trailing_dims(segments).items()}
    spans = [(0, 0, 0)] * len(segments)
    offsets = [0]
    for s in segments:
        offsets.append(offsets[-1] + len(s.token_ids))
    src, at_row, at_col = [], [], []  # every packed token: where it is in _columns' order, and its (row, column)
    for r, row in enumerate(rows):
        start = 0
        for k, members in (units[u] for u in row):
            for j, i in enumerate(members):
                skip = k if j else 0  # the first member brings the shared tokens, the others start after them
                n = len(segments[i].token_ids) - skip
                src.extend(range(offsets[i] + skip, offsets[i + 1]))
                at_row.extend([r] * n)
                at_col.extend(range(start, start + n))
                if segments[i].routed_experts is not None:  # (n, layers, top_k)
                    cols["routed_experts"][r, start:start + n] = torch.as_tensor(segments[i].routed_experts[skip:],
                                                                                 dtype=torch.int32)
                spans[i], start = (r, start, n), start + n
        cols["position_ids"][r, start:] = torch.arange(width - start)  # padding: its own segment
    src, at_row, at_col = torch.tensor(src), torch.tensor(at_row), torch.tensor(at_col)
    for name, v in _columns(segments, advantages).items():
        cols[name][at_row, at_col] = v[src]
    images = {i: s.images for i, s in enumerate(segments) if s.images} or None  # for molt/actor/vision.py
    return Batch(spans=spans, images=images, **cols)


def micro_batches(batch: Batch, rows: int) -> list[Batch]:
    """Split into batches of `rows` rows, each trimmed to its longest row (less padding to compute).

    Segment ids still index the full segment list; `spans` stay with the full batch only.
    """
    out = []
    for a in range(0, batch.num_rows, rows):
        b = min(a + rows, batch.num_rows)
        width = int((batch.segment_ids[a:b] >= 0).sum(1).max())  # real tokens are left-aligned in each row
        out.append(batch.map(lambda _, x: x[a:b, :width]))
    return out


def scatter_loss_tokens(flat: torch.Tensor, mb: Batch, values: torch.Tensor, starts: torch.Tensor) -> None:
    """Write values (r, t) at a micro-batch's loss tokens into `flat`, every segment's tokens end to end (segment i
    from starts[i]). Placed by segment id and position (input-side columns), so right in either alignment and for
    any rank's rows or context-parallel slice."""
    rows, cols = mb.loss_mask.bool().nonzero(as_tuple=True)
    pos = mb.position_ids[rows, cols] + (0 if mb.targets is None else 1)  # next-token alignment: t predicts t + 1
    flat[starts[mb.segment_ids[rows, cols]] + pos] = values[rows, cols].to(flat.dtype)


def to_device(batch: Batch, device) -> Batch:
    return batch.map(lambda _, x: x.to(device))


NO_TARGET = -1  # `targets` where hidden t predicts nothing (segment end, padding); PAD_ID is a real token id
TARGET_SIDE = ("loss_mask", "behaviour_logp", "advantages")  # describe token t as predicted from hidden t-1


def _left(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], 1)  # (R, T): x[:, t + 1] at t, 0 at the end


def align_next(batch: Batch) -> Batch:
    """Next-token alignment: position t carries what hidden t predicts, `targets[t]` (the next token of the same
    segment, NO_TARGET if none), and the target-side columns move left by one with it. Input-side columns (ids,
    positions, segments, routed experts) stay. No prediction then needs another position's hidden state (under
    context parallelism it may live on another rank), and the loss is unchanged: log-probs, masks, behaviour
    log-probs and advantages all move together."""
    assert batch.targets is None, "the batch is already in the next-token alignment"
    seg = batch.segment_ids
    same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] >= 0)  # (R, T-1): t + 1 continues t's segment
    targets = torch.full_like(batch.input_ids, NO_TARGET)  # (R, T)
    targets[:, :-1] = torch.where(same, batch.input_ids[:, 1:], NO_TARGET)
    moved = {k: _left(getattr(batch, k)) for k in TARGET_SIDE}
    assert not (moved["loss_mask"].bool() & (targets == NO_TARGET)).any(), "a loss token starts a segment"
    return replace(batch, targets=targets, **moved)


def unalign(x: torch.Tensor) -> torch.Tensor:
    """Values in align_next's alignment -> the token alignment: (R, T), the value of token t at t, 0 at t = 0."""
    return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1)


def cp_width(width: int, cp: int) -> int:
    return -(-width // (2 * cp)) * 2 * cp  # rows padded to a multiple of 2*cp: 2*cp equal chunks


def cp_columns(width: int, cp: int, rank: int) -> torch.Tensor:
    """Global columns CP rank `rank` keeps, in its local order: of 2*cp equal chunks, chunks rank and
    2*cp-1-rank. Under causal attention chunk c costs ~c, so every rank's early + late pair costs the same."""
    assert width % (2 * cp) == 0 and 0 <= rank < cp, (width, cp, rank)
    return torch.arange(width).view(2 * cp, -1)[[rank, 2 * cp - 1 - rank]].flatten()  # (width // cp,)


def _pad_columns(x: torch.Tensor, width: int, fill) -> torch.Tensor:
    pad = torch.full((x.shape[0], width - x.shape[1], *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    return torch.cat([x, pad], 1)  # (R, width, ...)


def cp_slice(batch: Batch, cp: int, rank: int) -> tuple[Batch, torch.Tensor]:
    """CP rank `rank`'s load-balanced slice of every (R, T, ...) column (routed experts included), rows first
    padded to cp_width (as pack pads: segment -1, no target, mask 0), and the global column of each kept
    position, (T',). Needs align_next first: the token alignment predicts from the previous column."""
    assert batch.targets is not None, "cp_slice needs the next-token alignment: pack.align_next(batch) first"
    width = cp_width(batch.input_ids.shape[1], cp)
    cols = cp_columns(width, cp, rank)
    fill = {k: f for k, (f, _) in COLUMNS.items()} | {"targets": NO_TARGET}
    keep = cols.to(batch.input_ids.device)
    return batch.map(lambda k, x: _pad_columns(x, width, fill.get(k, 0))[:, keep]), cols


def cp_unslice(parts: list[torch.Tensor], width: int) -> torch.Tensor:
    """Inverse of cp_slice for one column: parts[r] (R, T', ...) from CP rank r -> (R, width, ...) in global order."""
    cp, padded = len(parts), parts[0].shape[1] * len(parts)
    full = parts[0].new_zeros((parts[0].shape[0], padded, *parts[0].shape[2:]))
    for r, part in enumerate(parts):
        full[:, cp_columns(padded, cp, r).to(part.device)] = part
    return full[:, :width]
