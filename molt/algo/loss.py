"""Policy losses: pure functions returning (loss, metrics), chosen by name (`loss=ppo_clip|gspo|cispo`), with
one global normalisation; and the Objective the actor calls, which adds IS weights, the KL penalty and entropy.

The loss of a micro-batch is its SUM of per-token losses divided by the number of loss tokens
in the WHOLE batch (all micro-batches, all data-parallel ranks). Summing the micro-batch
losses (and gradients) therefore gives the batch's token mean for any split. Metrics follow
the same rule: each is a sum over this micro-batch / num_loss_tokens, so they add up too
(except keys ending in `_min` / `_max`, which combine by min / max: see `combine`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from molt.algo.correction import behaviour_metrics, is_weights, per_sequence
from molt.config import LossConfig


def _clip_metrics(ratio: torch.Tensor, clipped: torch.Tensor, mask: torch.Tensor, num_loss_tokens: int) -> dict:
    """Fractions of loss tokens whose update the clip changed (below / above the band) and the mean ratio."""
    return {"clip/frac": clipped.sum() / num_loss_tokens,
            "clip/low_frac": (clipped & (ratio < 1)).sum() / num_loss_tokens,
            "clip/high_frac": (clipped & (ratio > 1)).sum() / num_loss_tokens,
            "ratio/mean": torch.where(mask, ratio.detach(), 0.0).sum() / num_loss_tokens}


def ppo_clip(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
             segment_ids: torch.Tensor, num_loss_tokens: int, cfg, weight: torch.Tensor | None = None):
    """Clipped surrogate (PPO, Schulman et al. 2017), all inputs (R, T):

    ratio = exp(logp - old_logp); loss_t = -w_t min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
    loss = sum_t mask_t * loss_t / num_loss_tokens; w_t = 1 unless importance weights are given.
    """
    mask = mask.bool()
    ratio = torch.exp(torch.where(mask, logp - old_logp, 0.0))  # (R, T), 1 off the mask
    unclipped = ratio * advantages  # (R, T)
    clipped = torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high) * advantages  # (R, T)
    per_token = -torch.minimum(unclipped, clipped) * (1.0 if weight is None else weight)  # (R, T)
    loss = torch.where(mask, per_token, 0.0).sum() / num_loss_tokens
    # clipped < unclipped: the clipped branch is taken and the token's gradient is zero
    return loss, {"loss/policy": loss.detach()} | _clip_metrics(ratio, (clipped < unclipped) & mask, mask,
                                                                 num_loss_tokens)


def gspo(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
         segment_ids: torch.Tensor, num_loss_tokens: int, cfg, weight: torch.Tensor | None = None):
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"), token form, all (R, T):

    s_i = exp(mean_{t in i} (logp - old_logp)), the length-normalised sequence ratio of sequence (segment) i;
    s_it = sg(s_i) * exp(logp_t - sg(logp_t)) (value s_i, gradient s_i grad logp_t);
    loss_t = -w_t min(s_it A_t, clip(s_it, 1 - clip_low, 1 + clip_high) A_t), summed / num_loss_tokens.
    With one advantage per sequence this is the paper's sequence objective (its GSPO-token form), the clip
    deciding for whole sequences; the sum is over tokens (Molt's one normalisation), not over sequences."""
    log_ratio = torch.where(mask.bool(), logp.detach() - old_logp, 0.0)  # (R, T)
    seq = per_sequence(log_ratio, segment_ids) / per_sequence(mask.float(), segment_ids).clamp(min=1)  # (R, T)
    # PPO's clip with the "old" log-prob shifted so that its ratio exp(logp - old) is s_it
    return ppo_clip(logp, logp.detach() - seq, advantages, mask, segment_ids, num_loss_tokens, cfg, weight)


def cispo(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
          segment_ids: torch.Tensor, num_loss_tokens: int, cfg, weight: torch.Tensor | None = None):
    """CISPO (MiniMax-M1, Chen et al. 2025): clip the importance weight, not the update, all (R, T):

    r_t = exp(logp - old_logp); loss_t = -w_t sg(clip(r_t, 1 - clip_low, 1 + clip_high)) A_t logp_t,
    summed / num_loss_tokens. Every token keeps a gradient (PPO zeroes clipped ones); the paper sets no lower
    bound (clip_low = 1) and tunes only clip_high."""
    m = mask.bool()
    ratio = torch.exp(torch.where(m, logp.detach() - old_logp, 0.0))  # (R, T)
    coef = torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high)  # detached: a weight, not a path for gradients
    per_token = -coef * advantages * logp * (1.0 if weight is None else weight)
    loss = torch.where(m, per_token, 0.0).sum() / num_loss_tokens
    return loss, {"loss/policy": loss.detach()} | _clip_metrics(ratio, (coef != ratio) & m, m, num_loss_tokens)


# train.loss -> pure function (logp, old_logp, advantages, mask, segment_ids, num_loss_tokens, cfg, weight)
# -> (loss, metrics); cfg is the `loss` config node (conf/loss/<name>.yaml holds its defaults)
LOSSES = {"ppo_clip": ppo_clip, "gspo": gspo, "cispo": cispo}
SEQUENCE_LOSSES = {"gspo"}  # aggregate over whole sequences: need them on one rank (fsdp.cp_size=1)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, num_loss_tokens: int,
               kl_coef: float) -> tuple[torch.Tensor, dict]:
    """kl_coef * k3 estimate of KL(pi || pi_ref) (Schulman 2020, "Approximating KL divergence"): with the
    sampled token and d = ref_logp - logp, k3 = exp(d) - d - 1 >= 0, unbiased for x ~ pi, low variance."""
    d = torch.where(mask.bool(), ref_logp - logp, 0.0)  # (R, T)
    k3 = (d.exp() - d - 1).sum() / num_loss_tokens
    return kl_coef * k3, {"kl/ref_k3": k3.detach(), "loss/kl": kl_coef * k3.detach()}


@dataclass
class Objective:
    """The actor's whole loss on one micro-batch: the policy loss chosen by name (LOSSES), off-policy IS weights,
    the KL penalty and the entropy metric. The actor calls it and knows nothing of what is inside."""

    loss: Any = field(default_factory=LossConfig)  # the `loss` config node
    is_correction: Any = None  # IsCorrectionConfig, or None = off
    kl_coef: float = 0.0

    @property
    def needs(self) -> tuple[str, ...]:
        """Helper models (molt/actor/helpers.py) scored on every micro-batch and passed to __call__ by name."""
        return ("reference",) if self.kl_coef > 0 else ()

    def __call__(self, logp: torch.Tensor, entropy: torch.Tensor, mb, num_loss_tokens: int, num_sequences: int,
                 reference: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """Without IS correction the loss's ratio is taken against the behaviour log-probs (PPO with mu as the old
        policy). With it, the ratio is taken against the actor's own detached log-probs (the proximal policy of
        decoupled PPO, Hilton et al. 2021) and the behaviour gap is carried by the IS weight instead: one optimizer
        step per batch makes that ratio 1, so the gradient is w_t A_t grad log pi(y_t)."""
        assert num_loss_tokens > 0, "the batch has no loss tokens"
        log_ratio = logp.detach() - mb.behaviour_logp  # (r, t)
        weight, metrics = is_weights(log_ratio, mb.loss_mask, mb.segment_ids, self.is_correction, num_loss_tokens,
                                     num_sequences)
        old = mb.behaviour_logp if weight is None else logp.detach()
        loss, m = LOSSES[self.loss.name](logp, old, mb.advantages, mb.loss_mask, mb.segment_ids, num_loss_tokens,
                                         self.loss, weight)
        metrics |= m | behaviour_metrics(log_ratio, mb.loss_mask, num_loss_tokens)
        metrics["entropy/mean"] = (entropy * mb.loss_mask).sum() / num_loss_tokens
        if reference is not None:
            kl, m = kl_penalty(logp, reference, mb.loss_mask, num_loss_tokens, self.kl_coef)
            loss, metrics = loss + kl, metrics | m
        return loss, metrics

    @classmethod
    def from_config(cls, cfg) -> Objective:
        return cls(cfg.loss, cfg.is_correction, cfg.train.kl_coef)


def value_loss(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, num_loss_tokens: int):
    """The critic's regression to the returns, all (R, T): loss = sum_t mask_t 0.5 (V - R)^2 / num_loss_tokens.
    No PPO value clip (V_old +- eps): the critic takes one optimizer step per batch, so V_old = V and it never binds."""
    per_token = 0.5 * (values - returns) ** 2  # (R, T)
    mask = mask.bool()
    loss = torch.where(mask, per_token, 0.0).sum() / num_loss_tokens
    err = torch.where(mask, (values.detach() - returns).abs(), 0.0)
    return loss, {"critic/loss": loss.detach(), "critic/abs_err": err.sum() / num_loss_tokens,
                  "critic/value_mean": torch.where(mask, values.detach(), 0.0).sum() / num_loss_tokens,
                  "critic/return_mean": torch.where(mask, returns, 0.0).sum() / num_loss_tokens}


def combine(totals: dict, metrics: dict) -> dict:
    """Fold one micro-batch's metrics into the running totals: sums, except `_min` / `_max` keys."""
    out = dict(totals)
    for k, v in metrics.items():
        v = torch.as_tensor(v).detach()
        fold = torch.minimum if k.endswith("_min") else torch.maximum if k.endswith("_max") else torch.add
        out[k] = fold(out[k], v) if k in out else v
    return out
