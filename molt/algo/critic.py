"""The critic of `estimator=gae`: the policy's architecture with a scalar value head, its own AdamW.

    critic = Critic(model_dir, cfg)          # body initialised from the policy's weights, head zero (V = 0)
    values = critic.values(segments)         # per token t: V(prefix before t), 0.0 at position 0
    metrics = critic.train_step(segments, returns)

It runs in the driver beside the actor, packs rows like the actor and uses the same global token-mean
normalisation. With one optimizer step per batch the old values equal the current ones, so the value
clip binds only if a batch is ever reused for several steps.
"""
from __future__ import annotations

import math

import torch

from molt.actor.actor import load_model, per_token
from molt.actor.pack import micro_batches, pack, to_device
from molt.algo.loss import combine, value_loss
from molt.types import Batch, Segment


class Critic:
    def __init__(self, model_dir, cfg, device: str = "cpu"):
        lm = load_model(model_dir, cfg.model.dtype, "sdpa", device)
        head = torch.nn.Linear(lm.get_output_embeddings().in_features, 1, device=device, dtype=lm.dtype)
        torch.nn.init.zeros_(head.weight)
        torch.nn.init.zeros_(head.bias)
        self.model = torch.nn.ModuleDict({"body": lm.get_decoder(), "head": head})  # the LM head is dropped
        self.train_cfg, self.clip, self.device = cfg.train, cfg.estimator.value_clip, torch.device(device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.estimator.critic_lr,
                                           betas=tuple(cfg.train.betas), weight_decay=cfg.train.weight_decay)

    def _values(self, mb: Batch) -> torch.Tensor:
        """(r, t): column t holds V of the prefix before token t (the state token t was sampled in), like log-probs."""
        hidden = self.model["body"](input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False)
        v = self.model["head"](hidden.last_hidden_state).squeeze(-1).float()  # (r, t): V after each position
        v = torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], 1)
        return torch.where((mb.position_ids > 0) & (mb.segment_ids >= 0), v, 0.0)

    def values(self, segments: list[Segment]) -> list[list[float]]:
        return per_token(self._values, segments, self.train_cfg, self.device)

    def train_step(self, segments: list[Segment], returns: list[list[float]]) -> dict[str, float]:
        """One AdamW step on the clipped value loss to per-token returns (0 off the loss mask)."""
        batch = pack(segments, returns, self.train_cfg.row_tokens)  # the returns ride in the advantages column
        n = int(batch.loss_mask.sum())
        self.optimizer.zero_grad(set_to_none=True)
        totals = {}
        for mb in micro_batches(batch, self.train_cfg.micro_batch_rows):
            mb = to_device(mb, self.device)
            v = self._values(mb)  # (r, t)
            loss, metrics = value_loss(v, v.detach(), mb.advantages, mb.loss_mask, n, self.clip)
            loss.backward()
            totals = combine(totals, metrics)
        max_norm = self.train_cfg.grad_clip if self.train_cfg.grad_clip > 0 else math.inf
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        if not math.isfinite(norm):
            raise FloatingPointError(f"critic gradient norm is {norm}: lower estimator.critic_lr")
        self.optimizer.step()
        return {k: float(v) for k, v in totals.items()} | {"critic/grad_norm": norm}

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
