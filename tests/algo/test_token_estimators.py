"""opd and gae end to end through `prepare` with real models: a frozen teacher and a trained critic, both helper
models of the actor (molt/actor/helpers.py), built from the run config by `run_actor`."""
import pytest
import torch
from omegaconf import OmegaConf

from molt import checkpoint
from molt.actor.actor import load_model, per_token, token_logprobs
from molt.actor.group import run_actor
from molt.algo.advantages import gae_raw, token_table
from molt.algo.loss import value_loss
from molt.assets import ensure_model, tokenizer_mismatch
from molt.config import EstimatorConfig, RunConfig, TrainConfig
from molt.loop import prepare, restore
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


def logprobs_of(model, segs, train):
    return per_token(lambda mb: token_logprobs(model, mb, 1.0), segs, train, "cpu")


def test_opd_advantage_is_teacher_minus_student(model_dir):
    cfg = run_cfg(name="opd", teacher_path=str(model_dir), opd_coef=0.5)
    actor = run_actor(cfg, model_dir)
    assert set(actor.helpers) == {"teacher"}
    segs = make_segments(seed=7, lengths=(6, 9, 5, 12, 7, 4, 8, 10))
    ref = logprobs_of(load_model(model_dir, "float32", "sdpa", "cpu", trainable=False), segs, cfg.train)
    shift = [0.1 * (i + 1) for i in range(len(segs))]  # student log-probs above the teacher's by `shift`
    segs = [Segment(s.token_ids, s.loss_mask, [(x + d) * m for x, m in zip(lp, s.loss_mask)], s.versions)
            for s, lp, d in zip(segs, ref, shift)]
    prep = prepare(groups_of(segs, [0.0] * 4), cfg, actor)
    for s, adv, d in zip(prep.segments, prep.advantages, shift):
        assert [pytest.approx(a, abs=1e-5) for a in adv] == [-0.5 * d * m for m in s.loss_mask]
    gen = [(d, s.num_generated) for s, d in zip(segs, shift)]
    assert prep.metrics["opd/reverse_kl"] == pytest.approx(sum(d * n for d, n in gen) / sum(n for _, n in gen),
                                                           abs=1e-5)
    assert prep.helper_targets == {}


def test_value_loss_hand_worked():
    v = torch.tensor([[1.0, 0.6, 5.0]], requires_grad=True)
    loss, m = value_loss(v, torch.tensor([[2.0, 0.0, 0.0]]), torch.tensor([[1.0, 1.0, 0.0]]), 4)
    # 0.5 ((1 - 2)^2 + .6^2) over 4 loss tokens of the whole batch; the third token is off the mask
    assert loss.item() == pytest.approx(0.5 * (1.0 + 0.36) / 4) and m["critic/abs_err"].item() == pytest.approx(1.6 / 4)
    loss.backward()
    assert v.grad.tolist() == [[pytest.approx(-1.0 / 4), pytest.approx(0.6 / 4), 0.0]]


def test_critic_learns_returns_and_gae_uses_it(model_dir):
    cfg = run_cfg(name="gae", gamma=1.0, lam=1.0, critic_lr=1e-2)
    actor = run_actor(cfg, model_dir)
    values = lambda: actor.score(segments, ["critic"])["critic"]  # noqa: E731
    segs = make_segments(seed=8, lengths=(6, 9, 5, 12, 7, 4, 8, 10))
    groups = groups_of(segs, [1.0, 0.0, 1.0, 0.5])
    prep = prepare(groups, cfg, actor)
    segments, returns = prep.segments, prep.helper_targets["critic"]
    assert all(v == 0.0 for s in values() for v in s)  # zero head: V = 0 before training
    # lam = gamma = 1 with V = 0: every generated token's return is its rollout's reward
    rollouts = [r for g in groups for r in g.rollouts]
    want = [[r.reward * m for m in s.loss_mask] for r in rollouts for s in r.segments]
    assert [pytest.approx(x) for x in returns] == want
    losses = [actor.train_helpers(segments, prep.helper_targets)["critic/loss"] for _ in range(15)]
    assert losses[-1] < 0.4 * losses[0]  # at least the mean return is learned (prefixes are random tokens)
    v_now = values()
    assert all(v[0] == 0.0 for v in v_now)
    mask, v = token_table(rollouts, [s.loss_mask for s in segments]), token_table(rollouts, v_now)
    rewards = torch.tensor([r.reward for r in rollouts])
    # lam = gamma = 1: A_t = R - V_t, now smaller than with V = 0
    raw = gae_raw(rewards, v, mask, 1.0, 1.0)
    torch.testing.assert_close(raw, (rewards[:, None] - v) * mask)
    assert raw.abs().sum() < 0.6 * (mask * rewards[:, None]).sum()


def test_checkpoint_keeps_the_critic_and_exports_a_teacher(model_dir, tmp_path):
    cfg = run_cfg(name="gae", critic_lr=1e-2)
    actor = run_actor(cfg, model_dir)
    segs = make_segments(seed=9)
    segs = [Segment(s.token_ids, s.loss_mask, [x * m for x, m in zip(lp, s.loss_mask)], s.versions)
            for s, lp in zip(segs, actor.logprobs(segs))]
    actor.train_step(segs, [1.0] * len(segs))
    actor.train_helpers(segs, {"critic": [[1.0 * m for m in s.loss_mask] for s in segs]})
    path = checkpoint.save(str(tmp_path / "ckpt"), 1, actor, 0, model_dir)
    cfg.resume, cfg.checkpoint_dir = True, str(tmp_path / "ckpt")
    other = run_actor(cfg, model_dir)
    assert restore(cfg, other) == (1, 0)
    values = actor.score(segs, ["critic"])["critic"]
    assert other.score(segs, ["critic"])["critic"] == values and max(map(max, values)) > 0
    assert other.logprobs(segs) == actor.logprobs(segs)
    plain = run_actor(run_cfg(name="grpo"), model_dir)
    checkpoint.save(str(tmp_path / "ckpt"), 2, plain, 0, model_dir)  # a run without a critic
    with pytest.raises(ValueError, match="holds no state for \\['critic'\\]"):
        restore(cfg, other)
    teacher = load_model(checkpoint.export_hf(path, tmp_path / "teacher"), "float32", "sdpa", "cpu")
    for a, b in zip(logprobs_of(teacher, segs, cfg.train), actor.logprobs(segs)):  # sdpa vs the actor's attention
        assert a == pytest.approx(b, abs=1e-5)
    assert tokenizer_mismatch(model_dir, tmp_path / "teacher") is None
