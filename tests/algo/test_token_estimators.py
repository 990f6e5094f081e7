"""opd and gae end to end through `prepare` with real models: a frozen teacher, a trained critic."""
import pytest
import torch
from omegaconf import OmegaConf

from molt import checkpoint, guards
from molt.actor.actor import Actor, load_model, segment_logprobs
from molt.algo.advantages import gae_raw, token_table
from molt.algo.critic import Critic
from molt.algo.loss import value_loss
from molt.assets import ensure_model
from molt.config import EstimatorConfig, RunConfig, TrainConfig
from molt.loop import prepare, restore, train_critic
from molt.types import Group, Rollout, Segment
from tests.actor.test_actor import make_segments


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_model(tmp_path_factory.mktemp("assets") / "tiny", "tiny")


def run_cfg(**estimator):
    return OmegaConf.structured(RunConfig(estimator=EstimatorConfig(**estimator), train=TrainConfig(row_tokens=64)))


def groups_of(segments, rewards):
    """Rollout i has segments[2i:2i+2] (a compacted rollout of two segments); two rollouts per group."""
    rollouts = [Rollout(f"r{i}", f"g{i // 2}", segments[2 * i:2 * i + 2], rewards[i]) for i in range(len(rewards))]
    return [Group(f"g{k}", {}, rollouts[2 * k:2 * k + 2]) for k in range(len(rollouts) // 2)]


def test_opd_advantage_is_teacher_minus_student(model_dir):
    cfg = run_cfg(name="opd", teacher_path=str(model_dir), opd_coef=0.5)
    teacher = load_model(model_dir, "float32", "sdpa", "cpu", trainable=False)
    segs = make_segments(seed=7, lengths=(6, 9, 5, 12, 7, 4, 8, 10))
    ref = segment_logprobs(teacher, segs, 1.0, cfg.train, "cpu")
    shift = [0.1 * (i + 1) for i in range(len(segs))]  # student log-probs above the teacher's by `shift`
    segs = [Segment(s.token_ids, s.loss_mask, [(x + d) * m for x, m in zip(lp, s.loss_mask)], s.versions)
            for s, lp, d in zip(segs, ref, shift)]
    segments, per_segment, metrics, returns = prepare(groups_of(segs, [0.0] * 4), cfg, {"teacher": teacher})
    for s, adv, d in zip(segments, per_segment, shift):
        assert [pytest.approx(a, abs=1e-5) for a in adv] == [-0.5 * d * m for m in s.loss_mask]
    gen = [(d, s.num_generated) for s, d in zip(segs, shift)]
    assert metrics["opd/reverse_kl"] == pytest.approx(sum(d * n for d, n in gen) / sum(n for _, n in gen), abs=1e-5)
    assert returns is None


def test_value_loss_clip_hand_worked():
    v = torch.tensor([[1.0, 0.6]], requires_grad=True)
    loss, m = value_loss(v, torch.tensor([[0.5, 0.5]]), torch.tensor([[2.0, 0.0]]), torch.ones(1, 2), 2, 0.2)
    # token 0: V_c = .7, max((1 - 2)^2, (.7 - 2)^2) = 1.69, the clipped branch: no gradient; token 1: inside the clip
    assert loss.item() == pytest.approx(0.5 * (1.69 + 0.36) / 2)
    loss.backward()
    assert v.grad.tolist() == [[0.0, pytest.approx(0.6 / 2)]]


def test_critic_learns_returns_and_gae_uses_it(model_dir, tmp_path):
    cfg = run_cfg(name="gae", gamma=1.0, lam=1.0, critic_lr=1e-2)
    critic = Critic(model_dir, cfg)
    segs = make_segments(seed=8, lengths=(6, 9, 5, 12, 7, 4, 8, 10))
    groups = groups_of(segs, [1.0, 0.0, 1.0, 0.5])
    segments, per_segment, _, returns = prepare(groups, cfg, {"critic": critic})
    assert all(v == 0.0 for s in critic.values(segments) for v in s)  # zero head: V = 0 before training
    # lam = gamma = 1 with V = 0: every generated token's return is its rollout's reward
    rollouts = [r for g in groups for r in g.rollouts]
    want = [[r.reward * m for m in s.loss_mask] for r in rollouts for s in r.segments]
    assert [pytest.approx(x) for x in returns] == want
    losses = [train_critic({"critic": critic}, segments, returns)["critic/loss"] for _ in range(15)]
    assert losses[-1] < 0.4 * losses[0]  # at least the mean return is learned (prefixes are random tokens)
    values = critic.values(segments)
    assert all(v[0] == 0.0 for v in values)
    mask, v = token_table(rollouts, [s.loss_mask for s in segments]), token_table(rollouts, values)
    rewards = torch.tensor([r.reward for r in rollouts])
    # lam = gamma = 1: A_t = R - V_t, now smaller than with V = 0
    raw = gae_raw(rewards, v, mask, 1.0, 1.0)
    torch.testing.assert_close(raw, (rewards[:, None] - v) * mask)
    assert raw.abs().sum() < 0.6 * (mask * rewards[:, None]).sum()
    other = Critic(model_dir, cfg)
    other.load_state_dict(critic.state_dict())
    assert other.values(segments) == values


def test_checkpoint_keeps_the_critic_and_exports_a_teacher(model_dir, tmp_path):
    cfg = run_cfg(name="gae", critic_lr=1e-2)
    actor, critic = Actor(model_dir, cfg.train), Critic(model_dir, cfg)
    segs = make_segments(seed=9)
    segs = [Segment(s.token_ids, s.loss_mask, [x * m for x, m in zip(lp, s.loss_mask)], s.versions)
            for s, lp in zip(segs, actor.logprobs(segs))]
    actor.train_step(segs, [1.0] * len(segs))
    critic.train_step(segs, [[1.0 * m for m in s.loss_mask] for s in segs])
    path = checkpoint.save(str(tmp_path / "ckpt"), 1, actor.state_dict(), 0, critic_state=critic.state_dict())
    cfg.resume, cfg.checkpoint_dir = True, str(tmp_path / "ckpt")
    other = Critic(model_dir, cfg)
    assert restore(cfg, Actor(model_dir, cfg.train), other) == (1, 0)
    assert other.values(segs) == critic.values(segs) and max(map(max, critic.values(segs))) > 0
    checkpoint.save(str(tmp_path / "ckpt"), 2, actor.state_dict(), 0)  # a run without a critic
    with pytest.raises(ValueError, match="holds no critic"):
        restore(cfg, actor, other)
    teacher = load_model(checkpoint.export_hf(path, model_dir, tmp_path / "teacher"), "float32", "sdpa", "cpu")
    assert segment_logprobs(teacher, segs, 1.0, cfg.train, "cpu") == actor.logprobs(segs)
    assert guards.tokenizer_mismatch(model_dir, tmp_path / "teacher") is None
