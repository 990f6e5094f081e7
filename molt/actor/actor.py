"""The single-process policy actor: a Hugging Face causal LM, AdamW, packed rows, one global loss normalisation.

    actor = Actor("assets/tiny", TrainConfig())
    metrics = actor.train_step(segments, advantages)   # pack -> micro-batches -> backward -> clip -> step
    engine_weights = actor.export_weights()            # HF names, fp32, lm_head.weight always present

The model runs in eval mode (no dropout) so its forward is the engine's forward; gradients flow as usual.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM

from molt.actor.pack import micro_batches, pack, to_device
from molt.algo.loss import policy_loss
from molt.types import Batch, Segment

if TYPE_CHECKING:  # molt.config imports Hydra, which the GPU image lacks
    from molt.config import TrainConfig

ATTENTION = ("sdpa", "eager")  # both honour packed rows through position_ids (see pack.py)
HEAD_CHUNK = 1024  # tokens per vocabulary projection: bounds the live (tokens, vocab) logits


def _chosen_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                     temperature: float) -> torch.Tensor:
    logits = head(hidden).float() / temperature  # (N, V); engines report log-probs after temperature
    return logits.gather(-1, targets[:, None]).squeeze(-1) - logits.logsumexp(-1)  # (N,)


def head_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                  chunk: int = HEAD_CHUNK) -> torch.Tensor:
    """log p(targets | hidden), chunk by chunk; under grad each chunk's logits are recomputed in backward
    (checkpoint) instead of being kept, so at most `chunk` x vocab logits live at once."""
    grad = torch.is_grad_enabled()
    parts = [checkpoint(_chosen_logprobs, head, h, t, temperature, use_reentrant=False) if grad
             else _chosen_logprobs(head, h, t, temperature)
             for h, t in zip(hidden.split(chunk), targets.split(chunk))]
    return torch.cat(parts)  # (N,)


def token_logprobs(model, batch: Batch, temperature: float = 1.0, loss_only: bool = False) -> torch.Tensor:
    """Per-token log p(token_t | segment prefix), (R, T); 0 at segment starts, padding (and mask-0 tokens if loss_only).

    Logits at t predict t+1. Gotcha: transformers derives the block-diagonal causal mask from the
    position resets only when there is no 2-D attention mask AND no KV cache; use_cache=False is
    required (the config default builds a cache, and then packed segments attend to each other).
    """
    assert temperature > 0, "log-probs need a sampling temperature > 0 (rollout.temperature)"
    out = model.get_decoder()(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)
    hidden = out.last_hidden_state  # (R, T, H)
    want = batch.loss_mask.bool() if loss_only else (batch.position_ids > 0) & (batch.segment_ids >= 0)  # (R, T)
    rows, cols = want.nonzero(as_tuple=True)  # (N,), (N,): token (r, c) is predicted from hidden (r, c - 1)
    lp = head_logprobs(model.get_output_embeddings(), hidden[rows, cols - 1], batch.input_ids[rows, cols], temperature)
    return torch.zeros(want.shape, dtype=lp.dtype, device=lp.device).index_put((rows, cols), lp)  # (R, T)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"model.dtype={name!r} is not a torch dtype (use float32 or bfloat16)")
    return dtype


class Actor:
    def __init__(self, model_dir: str | Path, train: TrainConfig, dtype: str = "float32",
                 attn_implementation: str = "sdpa", device: str = "cpu"):
        if attn_implementation not in ATTENTION:
            raise ValueError(f"attn_implementation={attn_implementation!r}: use one of {ATTENTION}")
        if train.num_threads > 0:
            torch.set_num_threads(train.num_threads)
        self.cfg, self.device = train, torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=_dtype(dtype),
                                                          attn_implementation=attn_implementation).to(self.device)
        self.model.eval()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=train.lr, betas=tuple(train.betas),
                                           weight_decay=train.weight_decay)

    def backward(self, segments: list[Segment], advantages: list, temperature: float = 1.0,
                 num_loss_tokens: int | None = None) -> dict[str, float]:
        """Accumulate the batch's policy gradient into .grad (no step). num_loss_tokens defaults to this
        batch's count; data-parallel callers pass the all-ranks total."""
        batch = pack(segments, advantages, self.cfg.row_tokens)
        local_loss_tokens = int(batch.loss_mask.sum())
        n = num_loss_tokens or local_loss_tokens
        if n == 0:
            raise ValueError("the batch has no generated (loss-mask 1) tokens to train on")
        totals: dict[str, torch.Tensor] = {}
        worst = torch.zeros((), device=self.device)
        for mb in micro_batches(batch, self.cfg.micro_batch_rows):
            mb = to_device(mb, self.device)
            logp = token_logprobs(self.model, mb, temperature, loss_only=True)  # (r, t)
            loss, metrics = policy_loss(logp, mb.behaviour_logp, mb.advantages, mb.loss_mask, n,
                                        self.cfg.clip_low, self.cfg.clip_high)
            loss.backward()
            gap = (logp.detach() - mb.behaviour_logp).abs() * mb.loss_mask  # (r, t), before any update
            metrics["mismatch/logprob_abs_mean"] = gap.sum() / n
            worst = torch.maximum(worst, gap.max())
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + v
        out = {k: float(v) for k, v in totals.items()}
        out.update({"mismatch/logprob_abs_max": float(worst), "tokens/loss": float(local_loss_tokens),
                    "tokens/total": float((batch.segment_ids >= 0).sum()), "rows": float(batch.num_rows)})
        return out

    def train_step(self, segments: list[Segment], advantages: list, temperature: float = 1.0) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        metrics = self.backward(segments, advantages, temperature)
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"gradient norm is {norm}; step skipped (lower train.lr or set train.grad_clip)")
        self.optimizer.step()
        return dict(metrics, grad_norm=norm)

    @torch.no_grad()
    def logprobs(self, segments: list[Segment], temperature: float = 1.0) -> list[list[float]]:
        """Per-token log-probs of each segment under the current weights (0.0 at position 0)."""
        batch = pack(segments, [0.0] * len(segments), self.cfg.row_tokens)
        out = torch.zeros(batch.input_ids.shape)  # (R, T)
        row = 0
        for mb in micro_batches(batch, self.cfg.micro_batch_rows):
            lp = token_logprobs(self.model, to_device(mb, self.device), temperature).cpu()  # (r, t)
            out[row:row + mb.num_rows, :lp.shape[1]] = lp
            row += mb.num_rows
        return [out[r, s:s + n].tolist() for r, s, n in batch.spans]

    def export_weights(self) -> dict[str, torch.Tensor]:
        """HF-named fp32 CPU copies (safe to write while training continues). `lm_head.weight` is always
        included: with tied embeddings an engine reloading weights keeps a stale head otherwise."""
        weights = {k: v.detach().to("cpu", torch.float32, copy=True).contiguous()
                   for k, v in self.model.state_dict().items()}
        head = self.model.get_output_embeddings()
        if "lm_head.weight" not in weights and head is not None:
            weights["lm_head.weight"] = head.weight.detach().to("cpu", torch.float32, copy=True).contiguous()
        return weights

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
