"""Models an estimator or the loss needs beside the policy, built by the actor on its own device and layout.

    reference   the frozen initial policy (train.kl_coef > 0: the KL penalty, scored on every micro-batch); with LoRA
                the policy itself with its adapters bypassed (no second copy)
    teacher     a frozen model of the same tokenizer (estimator=opd: the teacher's log-probs)
    critic      the policy's architecture with a scalar value head and its own AdamW (estimator=gae)

Which ones a run builds is said by the registry entries that need them (`Estimator.helpers` in
molt/algo/advantages.py, `Objective.needs` in molt/algo/loss.py); the loop never names them. Every helper
scores packed micro-batches in the actor's alignment (`token_logprobs`'s: a value at t describes token t), so
a data-, expert- or context-parallel actor runs its helpers sharded the same way.
"""
from __future__ import annotations

import math

import torch

from molt.actor import lora, replay
from molt.actor.actor import token_logprobs
from molt.actor.context import forward_kwargs
from molt.actor.pack import NO_TARGET, pack
from molt.algo.loss import combine, value_loss
from molt.types import Batch


class Frozen:
    """A frozen causal LM: its log-probs of the batch's tokens. `model`: score that one's base (LoRA adapters
    bypassed) instead of loading `path`."""

    def __init__(self, actor, path, replay: bool, model=None):
        self.model = model if model is not None else actor.build(path, trainable=False, replay=replay)

    def score(self, mb: Batch, temperature: float, loss_only: bool = False) -> torch.Tensor:
        # the reference routes as the policy does (no-op unless installed); adapters off (no-op without)
        with replay.routes(self.model, mb), lora.disabled(self.model):
            return token_logprobs(self.model, mb, temperature, loss_only=loss_only)  # (r, t)


class Critic:
    """V(prefix before token t) at t: the policy's body (initialised from its weights) and a zero value head, so
    V = 0 at the start. One AdamW step per batch on the value loss, with the actor's packing, sharding and global
    normalisation."""

    def __init__(self, actor, path, lr: float):
        self.actor = actor
        # the value head sits on the root (FSDP shards it too), zero-initialised; lm_head stays unused (no gradient)
        head = lambda m: torch.nn.Linear(m.get_output_embeddings().in_features, 1, dtype=m.dtype)  # noqa: E731
        self.model = actor.build(path, trainable=True, replay=False, fresh={"molt_value_head": head})
        self.optimizer = actor.adamw(self.model, lr)

    def score(self, mb: Batch, temperature: float = 1.0) -> torch.Tensor:
        """(r, t) values in the batch's alignment, 0 where no token is predicted (as token_logprobs)."""
        hidden = self.model.get_decoder()(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False,
                                          **forward_kwargs(self.model, mb)).last_hidden_state
        v = self.model.molt_value_head(hidden).squeeze(-1).float()  # (r, t): V after each position
        if mb.targets is not None:  # next-token alignment: hidden t describes token t + 1
            return torch.where(mb.targets != NO_TARGET, v, 0.0)
        v = torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], 1)
        return torch.where((mb.position_ids > 0) & (mb.segment_ids >= 0), v, 0.0)

    def train_step(self, segments, returns: list[list[float]]) -> dict[str, float]:
        """One AdamW step on the value loss to per-token returns (0 off the loss mask)."""
        batch = pack(segments, returns, self.actor.cfg.row_tokens)  # the returns ride in the advantages column
        n = int(batch.loss_mask.sum())
        self.optimizer.zero_grad(set_to_none=True)
        totals = {}
        mbs = self.actor.micro_batches(batch)
        self.optimizer.stash = len(mbs) > 1  # MasterAdamW: several micro-batches accumulate in fp32
        for mb in mbs:
            loss, metrics = value_loss(self.score(mb), mb.advantages, mb.loss_mask, n)
            loss.backward()
            totals = combine(totals, metrics)
        norm = float(self.actor.clip_grads(self.model.parameters(), self.optimizer))
        if not math.isfinite(norm):
            raise FloatingPointError(f"critic gradient norm is {norm}: lower estimator.critic_lr")
        self.optimizer.step()
        return self.actor.reduce(totals) | {"critic/grad_norm": norm}


def build(name: str, actor, cfg, model_dir):
    """Helper `name` for the run `cfg` (the loop's resolved config) beside the policy at `model_dir`."""
    e = cfg.estimator
    base = actor.model if actor.lora is not None else None  # LoRA: the reference is the policy's own base
    make = {"reference": lambda: Frozen(actor, model_dir, replay=cfg.train.routing_replay, model=base),
            "teacher": lambda: Frozen(actor, e.teacher_path, replay=False),  # its own routing: no replay
            "critic": lambda: Critic(actor, model_dir, e.critic_lr)}
    return make[name]()
