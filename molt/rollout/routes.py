"""Routed experts from vLLM (routing replay, engine side): wire payload -> per-token routes of a segment.

Wire format (shared/VLLM.md; `numpy2base64` in vllm): each choice's `routed_experts` is base64 of `.npy`
bytes, shape (num_tokens - 1, layers, top_k) over the call's prompt + output, dtype uint8 (<= 256 experts)
or uint16 (some versions send int32); a negative entry means unknown (e.g. a prefix-cache hit).
Row i is the route of token i, computed from token i's hidden state. The last sampled token has no row:
it was never fed through the model. Gotcha: vllm 0.32 sizes the layer axis by *all* decoder layers
(`total_num_hidden_layers`, dense ones included, indexed by layer number); replay.py accepts either that
or one row per MoE layer.

Our arrays are int32 with -1 for unknown, one row per token (the last token's row is -1), so
`Segment.routed_experts` is (len(token_ids), layers, top_k) like every other segment column
(`Segment.attach_routes` merges each call's routes into its segment).
"""
from __future__ import annotations

import base64
import binascii
import io

import numpy as np

from molt.types import ROUTE_DTYPE as DTYPE, ROUTE_UNKNOWN as UNKNOWN


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
