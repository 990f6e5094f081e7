"""What makes the actor fast on a GPU, applied to an unmodified Hugging Face model (instance-level, no model edits).

Measured by experiments/benchmarks/actor_gpu.py; the figures and what limits them are in docs/gpu.md.
- Attention over packed rows: the mask is block-diagonal causal (pack.py). With "sdpa" transformers materialises it as a
  dense (R, 1, T, T) boolean mask and SDPA runs its masked kernel over every score; with "flex_attention" transformers
  builds a BlockMask from the same position resets and the kernel skips the blocks that cross segments.
  flash-attention-2 kernels are not in the GPU image. On CPU "molt_varlen" (attention.py) runs causal SDPA per
  segment, never scoring across segments. `fast_attention(device)` picks the implementation.
- Experts: transformers' "grouped_mm" experts implementation (its default for models that support it) runs one layer's
  experts as two grouped GEMMs; "eager" loops over the experts in Python.
- Activation checkpointing (`train.activation_checkpointing`): keep only each decoder layer's input and recompute the
  layer in backward: about one more forward of compute for activation memory / num_layers. transformers' own gradient
  checkpointing runs only in train() mode, and the actor stays in eval() (no dropout: its forward is the engine's).
- The vocabulary head is chunked (actor.head_logprobs): (tokens, vocab) fp32 logits never exist at once.
"""
from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

ATTENTION_BY_DEVICE = {"cuda": "flex_attention", "cpu": "molt_varlen"}  # molt_varlen: molt/actor/attention.py


def fast_attention(device) -> str:
    """The attention implementation that is exact for packed rows and fastest on this device type."""
    return ATTENTION_BY_DEVICE.get(torch.device(device).type, "sdpa")


def decoder_layers(model) -> torch.nn.ModuleList:
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: no decoder `layers` list to checkpoint or compile; "
                         "set train.activation_checkpointing=false")
    return layers


def checkpoint_layers(model) -> int:
    """Recompute every decoder layer in backward instead of keeping its activations; returns the layers wrapped.

    Non-reentrant checkpointing: keyword arguments (position embeddings, the block mask) pass through, and it composes
    with FSDP2 (the layer's parameters are gathered before its backward, so the recompute finds them). Gotcha: the
    recompute runs during backward, so anything the forward read from a context (e.g. replayed expert routes) must
    still hold then, or the recomputed layer differs from the one whose activations were dropped."""
    layers = decoder_layers(model)
    for layer in layers:
        if not getattr(layer, "_molt_checkpointed", False):
            layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
            layer._molt_checkpointed = True
    return len(layers)


def compile_model(model, head_fn) -> None:
    """torch.compile each decoder layer's forward (after checkpoint_layers, so the recompute is compiled too), which
    fuses the norms, rotary embedding, SwiGLU and residual adds (layers share one code object, so they share compiled
    graphs), and the head's per-chunk log-prob function (`train.compile`): its fp32 cast, temperature, logsumexp,
    gather and entropy become a few fused kernels instead of passes over (chunk, vocab) fp32 logits."""
    for layer in decoder_layers(model):
        layer.forward = torch.compile(layer.forward)
    model.molt_head_fn = torch.compile(head_fn)  # read by actor.token_logprobs
