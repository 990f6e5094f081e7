"""Policy losses: pure functions returning (loss, metrics), with one global normalisation.

The loss of a micro-batch is its SUM of per-token losses divided by the number of loss tokens
in the WHOLE batch (all micro-batches, all data-parallel ranks). Summing the micro-batch
losses (and gradients) therefore gives the batch's token mean for any split. Metrics follow
the same rule: each is a sum over this micro-batch / num_loss_tokens, so they add up too.
"""
from __future__ import annotations

import torch


def policy_loss(logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                num_loss_tokens: int, clip_low: float, clip_high: float) -> tuple[torch.Tensor, dict]:
    """Clipped surrogate (PPO, Schulman et al. 2017), all inputs (R, T):

    ratio = exp(logp - behaviour_logp); loss_t = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
    loss = sum_t mask_t * loss_t / num_loss_tokens.
    """
    assert num_loss_tokens > 0, "the batch has no loss tokens"
    mask = mask.bool()
    ratio = torch.exp(torch.where(mask, logp - behaviour_logp, 0.0))  # (R, T), 1 off the mask
    unclipped = ratio * advantages  # (R, T)
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * advantages  # (R, T)
    per_token = -torch.minimum(unclipped, clipped)  # (R, T)
    loss = torch.where(mask, per_token, 0.0).sum() / num_loss_tokens
    # clipped < unclipped: the clipped branch is taken and the token's gradient is zero
    clip = (clipped < unclipped) & mask
    metrics = {"loss/policy": loss.detach(),
               "clip/frac": clip.sum() / num_loss_tokens,
               "clip/low_frac": (clip & (ratio < 1)).sum() / num_loss_tokens,
               "clip/high_frac": (clip & (ratio > 1)).sum() / num_loss_tokens,
               "ratio/mean": torch.where(mask, ratio.detach(), 0.0).sum() / num_loss_tokens}
    return loss, metrics
