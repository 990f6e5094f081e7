"""A GRPO step in plain torch, to hold Molt's update against (issue 26): a Hugging Face model, the group-normalised
advantage and the clipped surrogate written out here; no Molt code.

    adv = advantages(rewards, group_ids)                          # (R,)
    loss, norm = grpo_step(model, optimizer, samples, adv)        # samples: (token_ids, loss_mask, behaviour_logprobs)

    A_i    = (r_i - mean_g r) / (std_g r + eps)                    std over the group, population (1/n)
    rho_t  = exp(log pi(y_t) - log mu(y_t))                        mu: the behaviour log-probs the sampler reported
    loss   = -sum_{i,t} m_it min(rho_t A_i, clip(rho_t, 1 - clip_low, 1 + clip_high) A_i) / sum_{i,t} m_it

m_it = 1 on generated tokens (the end-of-sequence token included when it was sampled). The sequences are right-padded
into one batch (no packing), the gradient is clipped to a global norm, then the optimizer steps. tests/test_loop.py
checks Molt's loss, gradient and weights against this on replayed groups; experiments/benchmarks/parity.py trains
with it (and HF `generate`) for the learning comparison.
"""
from __future__ import annotations

import torch


def advantages(rewards, group_ids, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's group-normalised advantage per sample, (R,)."""
    rewards, ids = torch.as_tensor(rewards, dtype=torch.float64), torch.as_tensor(group_ids)
    adv = torch.zeros_like(rewards)
    for g in ids.unique():
        r = rewards[ids == g]
        adv[ids == g] = (r - r.mean()) / (r.std(unbiased=False) + eps)
    return adv.float()


def padded(samples) -> tuple[torch.Tensor, ...]:
    """(ids, attention mask, loss mask, behaviour log-probs), each (B, T), right-padded with zeros."""
    width = max(len(ids) for ids, _, _ in samples)
    ids, attn = torch.zeros(len(samples), width, dtype=torch.long), torch.zeros(len(samples), width, dtype=torch.long)
    mask, old = torch.zeros(len(samples), width), torch.zeros(len(samples), width)
    for i, (t, m, lp) in enumerate(samples):
        ids[i, :len(t)], attn[i, :len(t)] = torch.tensor(t), 1
        mask[i, :len(t)], old[i, :len(t)] = torch.tensor(m, dtype=torch.float32), torch.tensor(lp)
    return ids, attn, mask, old


def policy_loss(model, samples, adv: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.28,
                temperature: float = 1.0) -> torch.Tensor:
    ids, attn, mask, old = padded(samples)
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1].float() / temperature
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T-1): log p(ids[t+1] | ..t)
    mask, old = mask[:, 1:], old[:, 1:]
    ratio = torch.exp((logp - old) * mask)  # 1 off the mask
    a = adv[:, None]
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - clip_low, 1 + clip_high) * a)
    return -(surrogate * mask).sum() / mask.sum()


def grpo_step(model, optimizer, samples, adv: torch.Tensor, grad_clip: float = 1.0, **loss_kw) -> tuple[float, float]:
    """One optimizer step; returns (loss, gradient norm before clipping). The clipped gradients stay in .grad."""
    optimizer.zero_grad(set_to_none=True)
    loss = policy_loss(model, samples, adv, **loss_kw)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return loss.item(), norm.item()
