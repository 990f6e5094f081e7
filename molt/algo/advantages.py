"""Advantage estimators: pure functions of per-rollout rewards and group ids, chosen by name.

Reward estimators return one advantage per rollout (R,); the loop spreads it over the rollout's
generated tokens, so a rollout of several segments (context compaction) counts once in its group's
baseline. Token estimators (`opd`, `gae`) also take per-token tables (R, L) of each rollout's
generated tokens, in order across its segments (see `token_tables`), and return (R, L).
Adding an estimator = one function + one `ESTIMATORS` entry (everything else that knows its name: whether it
baselines against the group, the helper models it needs beside the policy (molt/actor/helpers.py) and the
table each fills, its config check and its logged metric) + its config fields in `EstimatorConfig` +
conf/estimator/<name>.yaml. A contract test checks that every parameter of every estimator is a per-token
table or an EstimatorConfig field.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from molt.assets import tokenizer_mismatch


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


def reinforce_pp(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ with a group-mean baseline (Hu 2025): a_i = r_i - mean_g r, then whitened over the
    whole batch, A_i = (a_i - mean_B a) / (std_B a + eps). Unlike GRPO, a group whose rewards barely
    differ keeps small advantages instead of being blown up by its own small std."""
    rewards = rewards.double()
    a = rewards - group_mean_std(rewards, group_ids)[0]  # (R,)
    return ((a - a.mean()) / (a.std(unbiased=False) + eps)).float()  # (R,)


def rloo(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024): A_i = r_i - mean_{j != i in g} r_j
    = n/(n-1) (r_i - mean_g r). A group of one (its other samples failed) has no baseline: A = 0."""
    rewards = rewards.double()
    _, inv, count = torch.unique(group_ids, return_inverse=True, return_counts=True)
    n = count[inv].double()  # (R,) the size of each sample's group
    a = (rewards - group_mean_std(rewards, group_ids)[0]) * n / (n - 1).clamp(min=1)
    return torch.where(n > 1, a, 0.0).float()  # (R,)


def opd(rewards: torch.Tensor, group_ids: torch.Tensor, student_logp: torch.Tensor, teacher_logp: torch.Tensor,
        mask: torch.Tensor, opd_coef: float = 1.0) -> torch.Tensor:
    """On-policy distillation (Agarwal et al. 2024, GKD; Gu et al. 2024, MiniLLM): the student samples, a frozen
    teacher scores the same tokens, A_t = -opd_coef (log pi_student(y_t) - log pi_teacher(y_t)), a per-token
    estimate of minus the reverse KL(student || teacher). Rewards are not used. All (R, L)."""
    return -opd_coef * (student_logp - teacher_logp) * mask  # (R, L)


def gae_raw(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
            lam: float) -> torch.Tensor:
    """GAE (Schulman et al. 2016) over a rollout's generated tokens, reward at the last one:
    delta_t = r_t + gamma V_{t+1} - V_t (V = 0 after the last token), A_t = sum_k (gamma lam)^k delta_{t+k}.
    values, mask (R, L) left-aligned; rewards (R,). Returns A (R, L); A + V are the critic's lambda-returns."""
    values = values * mask
    last = (mask.sum(1).long() - 1).clamp(min=0)  # (R,) index of the last generated token
    r = torch.zeros_like(values).index_put((torch.arange(len(rewards)), last), rewards.to(values.dtype))
    next_v = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], 1)  # (R, L), 0 past the end (padding)
    delta = (r + gamma * next_v - values) * mask  # (R, L)
    adv, running = torch.zeros_like(values), torch.zeros_like(rewards, dtype=values.dtype)
    for t in reversed(range(values.shape[1])):
        running = delta[:, t] + gamma * lam * running
        adv[:, t] = running
    return adv * mask


def gae(rewards: torch.Tensor, group_ids: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
        gamma: float = 1.0, lam: float = 0.95, eps: float = 1e-6) -> torch.Tensor:
    """PPO's advantages: `gae_raw`, whitened over the batch's generated tokens (mean 0, std 1). (R, L)."""
    adv = gae_raw(rewards, values, mask, gamma, lam)
    n = mask.sum()
    mean = adv.sum() / n
    std = (((adv - mean) * mask) ** 2).sum().div(n).sqrt()
    return (adv - mean) / (std + eps) * mask


def gae_targets(rewards: torch.Tensor, group_ids: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                gamma: float = 1.0, lam: float = 0.95) -> dict[str, torch.Tensor]:
    """The critic's regression targets: the lambda-returns A + V (before whitening), (R, L)."""
    return {"critic": gae_raw(rewards, values, mask, gamma, lam) + values}


def opd_check(cfg) -> str | None:
    """opd needs a teacher of the student's tokenizer, and takes no rewards."""
    teacher = cfg.estimator.teacher_path
    if not teacher or not (Path(teacher) / "config.json").exists():
        return (f"estimator=opd needs a teacher: estimator.teacher_path={teacher!r} holds no config.json; point it at "
                "a Hugging Face model directory that shares the student's tokenizer")
    # a student that is built later is checked when the teacher loads
    if (Path(cfg.model.path) / "config.json").exists() and (why := tokenizer_mismatch(cfg.model.path, teacher)):
        return (f"estimator.teacher_path={teacher} does not share model.path={cfg.model.path}'s tokenizer: {why}; "
                "the teacher scores the student's token ids, so choose a teacher of the same tokenizer")
    if cfg.filter.enabled:
        return ("filter.enabled=true drops groups by their rewards, which estimator=opd does not use: "
                "set filter.enabled=false")


def opd_metrics(tables: dict) -> dict[str, float]:
    """A sampled estimate of KL(student || teacher) per generated token."""
    mask = tables["mask"]
    return {"opd/reverse_kl": (((tables["student_logp"] - tables["teacher_logp"]) * mask).sum() / mask.sum()).item()}


def gae_check(cfg) -> str | None:
    e = cfg.estimator
    if not (0 <= e.gamma <= 1 and 0 <= e.lam <= 1 and e.critic_lr > 0):
        return (f"estimator=gae with gamma={e.gamma}, lam={e.lam}, critic_lr={e.critic_lr}: "
                "need 0 <= estimator.gamma, estimator.lam <= 1 and estimator.critic_lr > 0")


@dataclass(frozen=True)
class Estimator:
    fn: Callable  # (rewards (R,), group_ids (R,), per-token tables / config fields by name) -> (R,) or (R, L)
    group_baseline: bool = False  # baselines each sample against its group: rollout.n = 1 gives zero advantages
    helpers: dict[str, str] = field(default_factory=dict)  # model it needs beside the policy -> the table it fills
    targets: Callable | None = None  # same arguments -> {helper: (R, L) per-token targets it trains on}
    check: Callable = lambda cfg: None  # the run's config -> what is wrong with it for this estimator, or None
    metrics: Callable = lambda tables: {}  # the per-token tables -> {metric: value}, logged every step


ESTIMATORS = {"grpo": Estimator(grpo, group_baseline=True), "reinforce_pp": Estimator(reinforce_pp, group_baseline=True),
              "rloo": Estimator(rloo, group_baseline=True),
              "opd": Estimator(opd, helpers={"teacher": "teacher_logp"}, check=opd_check, metrics=opd_metrics),
              "gae": Estimator(gae, helpers={"critic": "values"}, targets=gae_targets, check=gae_check)}


def _bind(fn: Callable, cfg, rewards, group_ids, tables: dict):
    """Call fn(rewards, group_ids, ...): later arguments from `tables` (per-token (R, L) inputs) or `cfg` by name."""
    kwargs = {}
    for k, p in list(inspect.signature(fn).parameters.items())[2:]:
        if k in tables or hasattr(cfg, k):
            kwargs[k] = tables[k] if k in tables else getattr(cfg, k)
        assert k in kwargs or p.default is not p.empty, f"estimator {cfg.name} needs the per-token input {k!r}"
    # float64: a reward equal to its group's mean gets advantage 0, not float32 rounding / std (Adam would step on it)
    return fn(torch.as_tensor(rewards, dtype=torch.float64), torch.as_tensor(group_ids), **kwargs)


def compute_advantages(cfg, rewards: torch.Tensor, group_ids: torch.Tensor, **tables) -> torch.Tensor:
    """Dispatch on `estimator.name`; returns (R,) or (R, L). `tables`: those of `token_tables`."""
    if cfg.name not in ESTIMATORS:
        raise ValueError(f"estimator.name={cfg.name!r} is unknown; valid names: {sorted(ESTIMATORS)}")
    return _bind(ESTIMATORS[cfg.name].fn, cfg, rewards, group_ids, tables)


def helper_targets(cfg, rewards: torch.Tensor, group_ids: torch.Tensor, **tables) -> dict[str, torch.Tensor]:
    """What the estimator's trainable helpers regress on this step, {helper: (R, L)} ({} for most estimators)."""
    fn = ESTIMATORS[cfg.name].targets
    return _bind(fn, cfg, rewards, group_ids, tables) if fn else {}


def token_tables(est: Estimator, rollouts: list, scores: dict[str, list[list[float]]]) -> dict[str, torch.Tensor]:
    """The per-token (R, L) inputs of an estimator: the loss mask, the behaviour log-probs it sampled with
    (student_logp) and, under the table names of its entry, the per-segment scores of its helpers."""
    segments = [s for r in rollouts for s in r.segments]
    tables = {"mask": token_table(rollouts, [s.loss_mask for s in segments]),
              "student_logp": token_table(rollouts, [s.logprobs for s in segments])}
    return tables | {est.helpers[n]: token_table(rollouts, v) for n, v in scores.items()}


def token_table(rollouts: list, columns: list[list[float]]) -> torch.Tensor:
    """Per-token columns (one list per segment, segments in rollout order) -> (R, L): each rollout's generated
    tokens in order across its segments, left-aligned, 0-padded."""
    it = iter(columns)
    rows = [torch.tensor([x for s in r.segments for x, m in zip(next(it), s.loss_mask) if m], dtype=torch.float32)
            for r in rollouts]
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)  # (R, L)


def untable(rollouts: list, table: torch.Tensor) -> list[list[float]]:
    """Inverse of `token_table`: one full-length list per segment, 0.0 on tokens that were not generated."""
    out = []
    for row, r in zip(table.tolist(), rollouts):
        it = iter(row)
        out += [[next(it) if m else 0.0 for m in s.loss_mask] for s in r.segments]
    return out
