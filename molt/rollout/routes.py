"""Routed experts from vLLM (routing replay, engine side): wire payload -> per-token routes of a segment.

Wire format (shared/VLLM.md; `numpy2base64` in vllm): each choice's `routed_experts` is base64 of `.npy`
bytes, shape (num_tokens - 1, layers, top_k) over the call's prompt + output, dtype uint8 (<= 256 experts)
or uint16 (some versions send int32); a negative entry means unknown (e.g. a prefix-cache hit).
Row i is the route of token i, computed from token i's hidden state. The last sampled token has no row:
it was never fed through the model. Gotcha: vllm 0.32 sizes the layer axis by *all* decoder layers
(`total_num_hidden_layers`, dense ones included, indexed by layer number); replay.py accepts either that
or one row per MoE layer.

Our arrays are int32 with -1 for unknown, one row per token (the last token's row is -1), so
`Segment.routed_experts` is (len(token_ids), layers, top_k) like every other segment column.
"""
from __future__ import annotations

import base64
import binascii
import io

import numpy as np

from molt.types import Segment

UNKNOWN = -1  # replay keeps the router's own top-k for such (token, layer) rows
DTYPE = np.int32  # holds uint16 expert ids and -1


def decode(b64: str, num_tokens: int) -> np.ndarray:
    """One engine call's routes over prompt + output, (num_tokens, layers, top_k) int32; last row UNKNOWN."""
    try:
        wire = np.load(io.BytesIO(base64.b64decode(b64, validate=True)), allow_pickle=False)
    except (binascii.Error, ValueError, OSError, EOFError) as e:
        raise ValueError(f"routed_experts from the engine is not a base64 .npy payload ({type(e).__name__}: {e}); "
                         f"is the engine a vLLM build whose wire format VLLM.md describes?") from e
    if wire.ndim != 3 or wire.dtype.kind not in "iu" or len(wire) != num_tokens - 1:
        raise ValueError(f"routed_experts from the engine is {wire.dtype} {wire.shape}; expected integer "
                         f"({num_tokens - 1}, layers, top_k) for a call of {num_tokens} prompt + output tokens")
    out = np.full((num_tokens, *wire.shape[1:]), UNKNOWN, DTYPE)
    out[:-1] = np.where(wire < 0, UNKNOWN, wire)  # uint16 ids up to 65535 fit int32
    return out


def attach(seg: Segment, routes: np.ndarray | None) -> None:
    """Give `seg` the routes of its latest engine call, after the call's output was appended.

    The call's prompt was the segment's prefix, so row i of `routes` (prompt + output) is token i of the
    segment; output cut short (a stop string) keeps only its first rows. A later call re-routes the same
    prefix, so its rows replace older ones, except where it knows nothing (-1, a prefix-cache hit: the
    older call computed those tokens). Tokens no call has fed (the last one) stay -1.
    """
    old, n = seg.routed_experts, len(seg.token_ids)
    if routes is None and old is None:
        return
    shape = (routes if routes is not None else old).shape[1:]
    assert old is None or old.shape[1:] == shape, f"routes of shape {shape} for a segment routed as {old.shape}"
    out = np.full((n, *shape), UNKNOWN, DTYPE)  # (n, layers, top_k)
    if old is not None:
        out[:min(n, len(old))] = old[:n]
    if routes is not None:
        new = routes[:n]
        known = (new >= 0).all(-1)  # (m, layers)
        out[:len(new)][known] = new[known]
    seg.routed_experts = out
