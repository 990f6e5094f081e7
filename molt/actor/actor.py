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
from molt.algo.loss import actor_loss, combine
from molt.types import Batch, Segment

if TYPE_CHECKING:  # molt.config imports Hydra, which the GPU image lacks
    from molt.config import IsCorrectionConfig, TrainConfig

ATTENTION = ("sdpa", "eager")  # both honour packed rows through position_ids (see pack.py)
HEAD_CHUNK = 1024  # tokens per vocabulary projection: bounds the live (tokens, vocab) logits


def _chosen_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                     entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits = head(hidden).float() / temperature  # (N, V); engines report log-probs after temperature
    lse = logits.logsumexp(-1)  # (N,)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse  # (N,)
    if not entropy:
        return logp, None
    with torch.no_grad():  # logged only: H = logsumexp(z) - sum_v softmax(z)_v z_v
        return logp, lse - (logits.softmax(-1) * logits).sum(-1)  # (N,), (N,)


def head_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                  chunk: int = HEAD_CHUNK, entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets | hidden) and (if asked) the entropy of each token's distribution, chunk by chunk;
    under grad each chunk's logits are recomputed in backward (checkpoint) instead of being kept, so at most
    `chunk` x vocab logits live at once."""
    grad = torch.is_grad_enabled()
    parts = [checkpoint(_chosen_logprobs, head, h, t, temperature, entropy, use_reentrant=False) if grad
             else _chosen_logprobs(head, h, t, temperature, entropy)
             for h, t in zip(hidden.split(chunk), targets.split(chunk))]
    logp = torch.cat([p[0] for p in parts])  # (N,)
    return logp, torch.cat([p[1] for p in parts]) if entropy else None


def token_logprobs(model, batch: Batch, temperature: float = 1.0, loss_only: bool = False,
                   entropy: bool = False):
    """Per-token log p(token_t | segment prefix), (R, T); 0 at segment starts, padding (and mask-0 tokens if loss_only).
    With entropy=True returns (logp, entropy), both (R, T), the entropy of the distribution token t was drawn from.

    Logits at t predict t+1. Gotcha: transformers derives the block-diagonal causal mask from the
    position resets only when there is no 2-D attention mask AND no KV cache; use_cache=False is
    required (the config default builds a cache, and then packed segments attend to each other).
    """
    assert temperature > 0, "log-probs need a sampling temperature > 0 (rollout.temperature)"
    out = model.get_decoder()(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)
    hidden = out.last_hidden_state  # (R, T, H)
    want = batch.loss_mask.bool() if loss_only else (batch.position_ids > 0) & (batch.segment_ids >= 0)  # (R, T)
    rows, cols = want.nonzero(as_tuple=True)  # (N,), (N,): token (r, c) is predicted from hidden (r, c - 1)
    lp, ent = head_logprobs(model.get_output_embeddings(), hidden[rows, cols - 1], batch.input_ids[rows, cols],
                            temperature, entropy=entropy)
    scatter = lambda x: torch.zeros(want.shape, dtype=x.dtype, device=x.device).index_put((rows, cols), x)  # noqa: E731
    return (scatter(lp), scatter(ent)) if entropy else scatter(lp)  # (R, T)


def load_model(model_dir: str | Path, dtype: str, attn_implementation: str, device, trainable: bool = True):
    """A Hugging Face causal LM in eval mode (no dropout: its forward is the engine's); frozen unless trainable."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=_dtype(dtype),
                                                 attn_implementation=attn_implementation).to(device)
    return model.eval().requires_grad_(trainable)


@torch.no_grad()
def per_token(fn, segments: list[Segment], train: TrainConfig, device) -> list[list[float]]:
    """fn(micro-batch) -> (r, t) tensor, run over the packed segments and cut back into one list per segment."""
    batch = pack(segments, [0.0] * len(segments), train.row_tokens)
    out = torch.zeros(batch.input_ids.shape)  # (R, T)
    row = 0
    for mb in micro_batches(batch, train.micro_batch_rows):
        x = fn(to_device(mb, device)).float().cpu()  # (r, t)
        out[row:row + mb.num_rows, :x.shape[1]] = x
        row += mb.num_rows
    return [out[r, s:s + n].tolist() for r, s, n in batch.spans]


def segment_logprobs(model, segments: list[Segment], temperature: float, train: TrainConfig,
                     device) -> list[list[float]]:
    """Per-token log-probs of each segment under `model` (0.0 at position 0): the actor's, a teacher's."""
    return per_token(lambda mb: token_logprobs(model, mb, temperature), segments, train, device)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"model.dtype={name!r} is not a torch dtype (use float32 or bfloat16)")
    return dtype


class Actor:
    def __init__(self, model_dir: str | Path, train: TrainConfig, dtype: str = "float32",
                 attn_implementation: str = "sdpa", device: str = "cpu", is_correction: IsCorrectionConfig = None):
        if attn_implementation not in ATTENTION:
            raise ValueError(f"attn_implementation={attn_implementation!r}: use one of {ATTENTION}")
        if train.num_threads > 0:
            torch.set_num_threads(train.num_threads)
        self.cfg, self.device, self.is_correction = train, torch.device(device), is_correction
        self.model = load_model(model_dir, dtype, attn_implementation, self.device)
        # the KL penalty's reference: a frozen copy of the initial policy, loaded only when it is used
        self.reference = load_model(model_dir, dtype, attn_implementation, self.device, trainable=False) \
            if train.kl_coef > 0 else None
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=train.lr, betas=tuple(train.betas),
                                           weight_decay=train.weight_decay)

    def backward(self, segments: list[Segment], advantages: list, temperature: float = 1.0,
                 num_loss_tokens: int | None = None, num_sequences: int | None = None) -> dict[str, float]:
        """Accumulate the batch's policy gradient into .grad (no step). num_loss_tokens and num_sequences
        (segments with loss tokens) default to this batch's counts; data-parallel callers pass all-ranks totals."""
        batch = pack(segments, advantages, self.cfg.row_tokens)
        local_loss_tokens = int(batch.loss_mask.sum())
        n = num_loss_tokens or local_loss_tokens
        if n == 0:
            raise ValueError("the batch has no generated (loss-mask 1) tokens to train on")
        n_seq = num_sequences or sum(s.num_generated > 0 for s in segments)
        totals: dict[str, torch.Tensor] = {}
        for mb in micro_batches(batch, self.cfg.micro_batch_rows):
            mb = to_device(mb, self.device)
            logp, entropy = token_logprobs(self.model, mb, temperature, loss_only=True, entropy=True)  # (r, t) x 2
            ref = None
            if self.reference is not None:
                with torch.no_grad():
                    ref = token_logprobs(self.reference, mb, temperature, loss_only=True)  # (r, t)
            loss, metrics = actor_loss(logp, entropy, ref, mb, n, n_seq, self.cfg, self.is_correction)
            loss.backward()
            gap = (logp.detach() - mb.behaviour_logp).abs() * mb.loss_mask  # (r, t), before any update
            metrics |= {"mismatch/logprob_abs_mean": gap.sum() / n, "mismatch/logprob_abs_max": gap.max()}
            totals = combine(totals, metrics)
        out = {k: float(v) for k, v in totals.items()}
        out.update({"tokens/loss": float(local_loss_tokens), "tokens/total": float((batch.segment_ids >= 0).sum()),
                    "rows": float(batch.num_rows)})
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

    def logprobs(self, segments: list[Segment], temperature: float = 1.0) -> list[list[float]]:
        """Per-token log-probs of each segment under the current weights (0.0 at position 0)."""
        return segment_logprobs(self.model, segments, temperature, self.cfg, self.device)

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
