"""Routing replay for MoE policies: the actor's routers take the experts the engine chose.

    replay.install(model)                  # once, when train.routing_replay=true (before or after parallelize)
    with replay.routes(model, mb):         # per micro-batch, around its forward AND its backward
        loss = ...; loss.backward()

Why: top-k routing is discontinuous. Engine and actor logits differ by kernel/precision noise, a near-tie
between two experts flips, and that token's log-prob then differs by far more than the noise: the ratio
actor/behaviour is wrong for reasons unrelated to learning. Replaying the engine's choice (Rollout Routing
Replay, R3, Ma et al. 2025) removes that term. The router still computes its logits; only the top-k *indices*
are replaced, and the weights are the router's own function of the current logits at those experts, so the
router keeps receiving gradients.

The wrap is per instance (`gate.forward`), the model code is untouched; expert and context parallelism are
indifferent to it: the gate sees the rank's local (R*T, H) tokens and the batch's routes are sliced like every
other (R, T, ...) column. Hold the context through backward: activation checkpointing re-runs the routers there,
and a recompute that routed differently would not match the saved forward.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch

from molt.types import Batch


def _qwen3_weights(gate, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Qwen3MoeTopKRouter: softmax over all experts at the chosen ones, renormalised when norm_topk_prob."""
    w = logits.float().softmax(-1).gather(-1, idx)  # (N, K)
    if gate.norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    return w.to(logits.dtype)


def _deepseek_v3_weights(gate, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """DeepseekV3TopkRouter: sigmoid scores at the chosen experts (the correction bias only picks, never weighs),
    renormalised when norm_topk_prob, times routed_scaling_factor."""
    w = logits.sigmoid().gather(-1, idx)  # (N, K), logits are fp32 in this router
    if gate.norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * gate.routed_scaling_factor


# router class (transformers) -> its weights as a function of (router, logits, chosen experts)
WEIGHTS = {"Qwen3MoeTopKRouter": _qwen3_weights, "DeepseekV3TopkRouter": _deepseek_v3_weights}


@dataclass
class _Replay:
    """Per-model state: the routes of the current micro-batch, read by every wrapped router."""

    num_layers: int  # decoder layers: vLLM's layer axis (routes.py)
    num_moe: int  # routers: the layer axis of an engine that sends MoE layers only
    top_k: int
    num_experts: int
    routes: torch.Tensor | None = None  # (R, T, layers, top_k) while a routes() context is open


def _replayed(gate, forward, weights, state: _Replay, layer: int, ordinal: int, hidden: torch.Tensor):
    logits, w, idx = forward(hidden)  # (N, E), (N, K), (N, K)
    if state.routes is None:
        return logits, w, idx
    axis = layer if state.routes.shape[2] == state.num_layers else ordinal  # every layer, or the MoE ones only
    recorded = state.routes[:, :, axis].reshape(-1, state.top_k).to(idx.device)  # (N = R*T, K), the gate's order
    assert recorded.shape == idx.shape, f"routes for {tuple(recorded.shape)} but the router sees {tuple(idx.shape)}"
    known = (recorded >= 0).all(-1, keepdim=True)  # (N, 1); unknown rows keep the router's own choice
    idx = torch.where(known, recorded.long(), idx)
    return logits, weights(gate, logits, idx), idx


def _layer_index(name: str, default: int) -> int:
    m = re.search(r"\.layers\.(\d+)\.", name)  # model.layers.<i>.mlp.gate
    return int(m.group(1)) if m else default


def install(model) -> int:
    """Wrap every MoE router of `model` for replay (idempotent); returns how many."""
    if hasattr(model, "_molt_replay"):
        return model._molt_replay.num_moe
    gates = [(n, m) for n, m in model.named_modules() if type(m).__name__ in WEIGHTS]
    if not gates:
        raise ValueError(f"train.routing_replay=true but {type(model).__name__} has no router replay knows "
                         f"({', '.join(WEIGHTS)}): set train.routing_replay=false or add its weights to replay.WEIGHTS")
    first = gates[0][1]
    state = _Replay(model.config.num_hidden_layers, len(gates), first.top_k, first.num_experts)
    for ordinal, (name, gate) in enumerate(gates):
        gate.forward = partial(_replayed, gate, gate.forward, WEIGHTS[type(gate).__name__], state,
                               _layer_index(name, ordinal), ordinal)
    model._molt_replay = state
    return len(gates)


def _check(state: _Replay, routed: torch.Tensor) -> None:
    layers, k = routed.shape[2:]
    if layers not in (state.num_layers, state.num_moe) or k != state.top_k:
        raise ValueError(f"routed experts have {layers} layers x top-{k}; the actor's model has {state.num_layers} "
                         f"layers ({state.num_moe} MoE) x top-{state.top_k}: the engine serves another model "
                         f"(model.path)")
    if routed.numel() and int(routed.max()) >= state.num_experts:
        raise ValueError(f"routed expert id {int(routed.max())} >= num_experts={state.num_experts}: the engine "
                         f"serves another model (model.path)")


@contextmanager
def routes(model, batch: Batch):
    """Replay `batch.routed_experts` (R, T, layers, top_k) in `model`'s routers while inside (no-op unless installed).
    A batch of real tokens without routes is an error: training would silently run without replay."""
    state = getattr(model, "_molt_replay", None)
    if state is None or (batch.routed_experts is None and not (batch.segment_ids >= 0).any()):
        yield  # replay off, or an all-padding micro-batch
        return
    if batch.routed_experts is None:
        raise ValueError("train.routing_replay=true but this batch carries no routed experts: the engine returned "
                         "none (engine.return_routed_experts=true, GPU engines only) or set train.routing_replay=false")
    _check(state, batch.routed_experts)
    state.routes = batch.routed_experts
    try:
        yield
    finally:
        state.routes = None
