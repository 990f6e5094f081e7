"""Advantage estimators: pure functions of per-rollout rewards and group ids, chosen by name.

Each returns one advantage per rollout (R,); the loop spreads it over the rollout's generated
tokens. Adding an estimator = one function + one `ESTIMATORS` entry (+ `GROUP_BASELINE` if it
needs several samples per prompt) + its config fields in `EstimatorConfig`.
"""
from __future__ import annotations

import inspect

import torch


def group_mean_std(x: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and population std (unbiased=False) of x within each group, broadcast back to (R,)."""
    _, inv = torch.unique(group_ids, return_inverse=True)  # (R,) group index 0..G-1
    zeros = torch.zeros(int(inv.max()) + 1, dtype=x.dtype, device=x.device)
    count = zeros.index_add(0, inv, torch.ones_like(x))  # (G,)
    mean = zeros.index_add(0, inv, x) / count  # (G,)
    var = zeros.index_add(0, inv, (x - mean[inv]) ** 2) / count  # (G,)
    return mean[inv], var.sqrt()[inv]


def grpo(rewards: torch.Tensor, group_ids: torch.Tensor, std_normalize: bool = True,
         eps: float = 1e-6) -> torch.Tensor:
    """GRPO (Shao et al. 2024): A_i = (r_i - mean_g r) / (std_g r + eps), std_g = sqrt(mean_g (r - mean_g r)^2).

    std_normalize=False gives Dr. GRPO (Liu et al. 2025): A_i = r_i - mean_g r.
    """
    rewards = rewards.double()  # exact group means for small groups; cast back below
    mean, std = group_mean_std(rewards, group_ids)
    adv = rewards - mean
    return (adv / (std + eps) if std_normalize else adv).float()  # (R,)


ESTIMATORS = {"grpo": grpo}
GROUP_BASELINE = {"grpo"}  # estimators whose baseline is the group: n=1 gives zero advantages


def compute_advantages(cfg, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Dispatch on `estimator.name`; the estimator's keyword arguments are read from `cfg` by name."""
    if cfg.name not in ESTIMATORS:
        raise ValueError(f"estimator.name={cfg.name!r} is unknown; valid names: {sorted(ESTIMATORS)}")
    fn = ESTIMATORS[cfg.name]
    kwargs = {k: getattr(cfg, k) for k in list(inspect.signature(fn).parameters)[2:] if hasattr(cfg, k)}
    return fn(torch.as_tensor(rewards, dtype=torch.float32), torch.as_tensor(group_ids), **kwargs)
