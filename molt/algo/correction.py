"""Off-policy correction: importance weights from the ratio actor / behaviour, pure functions.

The tokens were sampled by the engine (behaviour mu: older weights, another kernel); the actor is
pi. With rho_t = pi(y_t) / mu(y_t) (detached), `is_correction.level` says what the band [low, high]
is applied to and `mode` what happens outside it:

    token  mask: w_t = rho_t if low <= rho_t <= high else 0        (masked IS)
           clip: w_t = clamp(rho_t, low, high)
           trunc: w_t = min(rho_t, high)                            (truncated IS; Ionides 2008)
    seq    gate on prod_t rho_t over the sequence, geo on exp(mean_t log rho_t):
           the whole sequence is masked out when outside the band; kept tokens carry w_t = rho_t.

A "sequence" is one packed segment (a segment never spans rows, so every micro-batch holds whole
ones). Gated tokens still count in the loss normaliser: the denominator is the batch's loss tokens.
"""
from __future__ import annotations

import math

import torch

LEVELS = {"off", "token", "seq", "geo"}
MODES = {"mask", "clip", "trunc"}
SEQ_LEVELS = {"seq", "geo"}


def per_sequence(x: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
    """Sum of x over each token's segment, broadcast back to every token of it: (R, T) -> (R, T)."""
    _, inv = torch.unique(segment_ids, return_inverse=True)  # (R, T) index 0..S-1
    sums = torch.zeros(int(inv.max()) + 1, dtype=x.dtype, device=x.device).index_add(0, inv.flatten(), x.flatten())
    return sums[inv]


def token_weights(log_ratio: torch.Tensor, mode: str, low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, acted) at the token level: acted marks tokens whose weight the band changed."""
    ratio = log_ratio.exp()
    outside = (ratio < low) | (ratio > high)
    if mode == "mask":
        return torch.where(outside, 0.0, ratio), outside
    if mode == "clip":
        return ratio.clamp(low, high), outside
    return ratio.clamp(max=high), ratio > high  # trunc: only the upper side is capped


def sequence_gate(log_ratio: torch.Tensor, mask: torch.Tensor, segment_ids: torch.Tensor, level: str,
                  low: float, high: float) -> torch.Tensor:
    """Per token (R, T): True where its sequence's aggregated ratio is outside [low, high] (log space: no overflow)."""
    total = per_sequence(log_ratio * mask, segment_ids)  # log prod_t rho_t
    if level == "geo":
        total = total / per_sequence(mask, segment_ids).clamp(min=1)  # log of the geometric mean
    log_low = math.log(low) if low > 0 else -math.inf
    return (total < log_low) | (total > math.log(high))


def is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, segment_ids: torch.Tensor, cfg, num_loss_tokens: int,
               num_sequences: int) -> tuple[torch.Tensor | None, dict]:
    """IS weights (R, T) for the loss tokens, or None when level=off (or cfg None); metrics are sums / batch totals.

    log_ratio = log pi - log mu, detached, (R, T); mask (R, T) 1 on loss tokens."""
    if cfg is None or cfg.level == "off":
        return None, {}
    mask_b = mask.bool()
    if cfg.level == "token":
        weight, acted = token_weights(log_ratio, cfg.mode, cfg.low, cfg.high)
        seq_gated = torch.zeros((), device=mask.device)
    else:
        gated = sequence_gate(log_ratio, mask, segment_ids, cfg.level, cfg.low, cfg.high)  # (R, T)
        weight, acted = torch.where(gated, 0.0, log_ratio.exp()), gated
        seq_gated = torch.tensor(float(segment_ids[gated & mask_b].unique().numel()), device=mask.device)
    return torch.where(mask_b, weight, 0.0), {"is/token_gated_frac": (acted & mask_b).sum() / num_loss_tokens,
                                              "is/seq_gated_frac": seq_gated / max(num_sequences, 1)}


def behaviour_metrics(log_ratio: torch.Tensor, mask: torch.Tensor, num_loss_tokens: int) -> dict:
    """Ratio actor / behaviour over the loss tokens (min, mean, max) and the k3 estimate of KL(mu || pi)
    (Schulman 2020, "Approximating KL divergence": with x ~ mu and r = pi/mu, k3 = r - 1 - log r >= 0)."""
    mask_b = mask.bool()
    ratio = log_ratio.exp()
    k3 = ratio - 1 - log_ratio
    return {"is/ratio_min": torch.where(mask_b, ratio, math.inf).min(),
            "is/ratio_mean": torch.where(mask_b, ratio, 0.0).sum() / num_loss_tokens,
            "is/ratio_max": torch.where(mask_b, ratio, -math.inf).max(),
            "kl/behaviour_k3": torch.where(mask_b, k3, 0.0).sum() / num_loss_tokens}
