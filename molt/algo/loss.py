"""Policy losses: pure functions returning (loss, metrics), with one global normalisation.

The loss of a micro-batch is its SUM of per-token losses divided by the number of loss tokens
in the WHOLE batch (all micro-batches, all data-parallel ranks). Summing the micro-batch
losses (and gradients) therefore gives the batch's token mean for any split. Metrics follow
the same rule: each is a sum over this micro-batch / num_loss_tokens, so they add up too
(except keys ending in `_min` / `_max`, which combine by min / max: see `combine`).
"""
from __future__ import annotations

import torch

from molt.algo.correction import behaviour_metrics, is_weights


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                num_loss_tokens: int, clip_low: float, clip_high: float,
                weight: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Clipped surrogate (PPO, Schulman et al. 2017), all inputs (R, T):

    ratio = exp(logp - old_logp); loss_t = -w_t min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
    loss = sum_t mask_t * loss_t / num_loss_tokens; w_t = 1 unless importance weights are given.
    """
    assert num_loss_tokens > 0, "the batch has no loss tokens"
    mask = mask.bool()
    ratio = torch.exp(torch.where(mask, logp - old_logp, 0.0))  # (R, T), 1 off the mask
    unclipped = ratio * advantages  # (R, T)
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * advantages  # (R, T)
    per_token = -torch.minimum(unclipped, clipped) * (1.0 if weight is None else weight)  # (R, T)
    loss = torch.where(mask, per_token, 0.0).sum() / num_loss_tokens
    # clipped < unclipped: the clipped branch is taken and the token's gradient is zero
    clip = (clipped < unclipped) & mask
    metrics = {"loss/policy": loss.detach(),
               "clip/frac": clip.sum() / num_loss_tokens,
               "clip/low_frac": (clip & (ratio < 1)).sum() / num_loss_tokens,
               "clip/high_frac": (clip & (ratio > 1)).sum() / num_loss_tokens,
               "ratio/mean": torch.where(mask, ratio.detach(), 0.0).sum() / num_loss_tokens}
    return loss, metrics


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, num_loss_tokens: int,
               kl_coef: float) -> tuple[torch.Tensor, dict]:
    """kl_coef * k3 estimate of KL(pi || pi_ref) (Schulman 2020, "Approximating KL divergence"): with the
    sampled token and d = ref_logp - logp, k3 = exp(d) - d - 1 >= 0, unbiased for x ~ pi, low variance."""
    d = torch.where(mask.bool(), ref_logp - logp, 0.0)  # (R, T)
    k3 = (d.exp() - d - 1).sum() / num_loss_tokens
    return kl_coef * k3, {"kl/ref_k3": k3.detach(), "loss/kl": kl_coef * k3.detach()}


def actor_loss(logp: torch.Tensor, entropy: torch.Tensor, ref_logp: torch.Tensor | None, mb, num_loss_tokens: int,
               num_sequences: int, train, is_correction) -> tuple[torch.Tensor, dict]:
    """The actor's whole loss on one micro-batch `mb` (a Batch): surrogate, IS weights, KL penalty, entropy.

    Without IS correction the surrogate's ratio is taken against the behaviour log-probs (PPO with mu as the
    old policy). With it, the ratio is taken against the actor's own detached log-probs (the proximal policy
    of decoupled PPO, Hilton et al. 2021) and the behaviour gap is carried by the IS weight instead: one
    optimizer step per batch makes that ratio 1, so the gradient is w_t A_t grad log pi(y_t)."""
    log_ratio = logp.detach() - mb.behaviour_logp  # (r, t)
    weight, metrics = is_weights(log_ratio, mb.loss_mask, mb.segment_ids, is_correction, num_loss_tokens,
                                 num_sequences)
    old = mb.behaviour_logp if weight is None else logp.detach()
    loss, m = policy_loss(logp, old, mb.advantages, mb.loss_mask, num_loss_tokens, train.clip_low, train.clip_high,
                          weight)
    metrics |= m | behaviour_metrics(log_ratio, mb.loss_mask, num_loss_tokens)
    metrics["entropy/mean"] = (entropy * mb.loss_mask).sum() / num_loss_tokens
    if ref_logp is not None:
        kl, m = kl_penalty(logp, ref_logp, mb.loss_mask, num_loss_tokens, train.kl_coef)
        loss, metrics = loss + kl, metrics | m
    return loss, metrics


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               num_loss_tokens: int, clip: float) -> tuple[torch.Tensor, dict]:
    """PPO's clipped value loss, all (R, T): V_c = V_old + clamp(V - V_old, -clip, clip),
    loss = sum_t mask_t 0.5 max((V - R)^2, (V_c - R)^2) / num_loss_tokens."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    per_token = 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)  # (R, T)
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
        if k not in out:
            out[k] = v
        elif k.endswith("_min"):
            out[k] = torch.minimum(out[k], v)
        elif k.endswith("_max"):
            out[k] = torch.maximum(out[k], v)
        else:
            out[k] = out[k] + v
    return out
