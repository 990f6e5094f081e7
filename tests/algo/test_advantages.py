"""Every estimator against values worked out by hand; dispatch; one baseline entry per multi-segment rollout."""
import math

import pytest
import torch
from omegaconf import OmegaConf

from molt.algo.advantages import (ESTIMATORS, compute_advantages, gae, gae_raw, grpo, opd, reinforce_pp, rloo, token_table,
                                  token_tables, untable)
from molt.config import EstimatorConfig, RunConfig
from molt.loop import prepare
from molt.types import Group, Rollout, Segment

REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 0.5, 1.0, 0.0, 0.0])
GROUPS = torch.tensor([7, 7, 3, 7, 7, 3, 9, 9, 9])  # groups interleaved and not numbered 0..G-1
# group 7: [1, 0, 0, 1] (mean 1/2); group 3: [.5, .5] (constant); group 9: [1, 0, 0] (mean 1/3)


def test_grpo_hand_worked():
    # group 7 std 1/2; group 3 std 0 -> 0 (eps keeps it finite); group 9 std sqrt(2)/3
    a, b, e = 0.5 / (0.5 + 1e-6), 1 / 3 / (math.sqrt(2) / 3 + 1e-6), 1e-6
    expected = torch.tensor([a, -a, 0, -a, a, 0, 2 * b, -b, -b])
    torch.testing.assert_close(grpo(REWARDS, GROUPS, eps=e), expected, rtol=0, atol=1e-7)
    assert grpo(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), eps=0.0).tolist() == [1.0, -1.0]


def test_dr_grpo_hand_worked():
    expected = torch.tensor([0.5, -0.5, 0, -0.5, 0.5, 0, 2 / 3, -1 / 3, -1 / 3])
    torch.testing.assert_close(grpo(REWARDS, GROUPS, std_normalize=False), expected)


def test_reinforce_pp_hand_worked():
    # minus group means: [.5, -.5, 0, -.5, .5, 0, 2/3, -1/3, -1/3]; batch mean 0;
    # batch variance (4 * 1/4 + 4/9 + 1/9 + 1/9) / 9 = 15/81, so A = a * 9 / sqrt(15)
    a = torch.tensor([0.5, -0.5, 0, -0.5, 0.5, 0, 2 / 3, -1 / 3, -1 / 3])
    torch.testing.assert_close(reinforce_pp(REWARDS, GROUPS, eps=0.0), a * 9 / math.sqrt(15))
    # the batch, not the group, normalises: a = [-.1, .1, -1, 1], batch std sqrt(2.02 / 4); GRPO gives +-1 for both
    a = torch.tensor([-0.1, 0.1, -1.0, 1.0])
    got = reinforce_pp(torch.tensor([0.2, 0.4, 3.0, 5.0]), torch.tensor([0, 0, 1, 1]), eps=0.0)
    torch.testing.assert_close(got, a / math.sqrt(2.02 / 4))


def test_rloo_hand_worked():
    # group 7, r=1: others [0, 0, 1] -> 1 - 1/3; r=0: others [1, 0, 1] -> -2/3; group 9, r=1: others [0, 0] -> 1;
    # r=0: others [1, 0] -> -1/2; group 3 constant -> 0
    expected = torch.tensor([2 / 3, -2 / 3, 0, -2 / 3, 2 / 3, 0, 1, -0.5, -0.5])
    torch.testing.assert_close(rloo(REWARDS, GROUPS), expected)
    assert rloo(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 5])).tolist() == [1.0, -1.0, 0.0]  # group of one


def test_compute_advantages_dispatch():
    cfg = EstimatorConfig(name="grpo", std_normalize=False)
    torch.testing.assert_close(compute_advantages(cfg, REWARDS.tolist(), GROUPS.tolist()),
                               grpo(REWARDS, GROUPS, std_normalize=False))
    torch.testing.assert_close(compute_advantages(EstimatorConfig(name="rloo"), REWARDS, GROUPS), rloo(REWARDS, GROUPS))
    with pytest.raises(ValueError, match=r"estimator.name='nope'.*\['gae', 'grpo'"):
        compute_advantages(EstimatorConfig(name="nope"), REWARDS, GROUPS)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_every_estimator_parameter_is_known(name):
    """Estimator arguments are bound by name (advantages._bind): a misspelt one would silently keep its default.
    Each must be a per-token table `token_tables` builds for the entry (its helpers' included) or an EstimatorConfig
    field; its metrics are floats computed from those tables."""
    import dataclasses
    import inspect

    fields = {f.name for f in dataclasses.fields(EstimatorConfig)}
    entry = ESTIMATORS[name]
    rollouts = [_rollout("r", "g", 1.0, 2)]
    scores = {h: [[-1.0] * len(s.token_ids) for s in rollouts[0].segments] for h in entry.helpers}
    tables = token_tables(entry, rollouts, scores)
    for fn in filter(None, (entry.fn, entry.targets)):
        params = list(inspect.signature(fn).parameters)
        assert params[:2] == ["rewards", "group_ids"], fn.__name__
        unknown = set(params[2:]) - set(tables) - fields
        assert not unknown, f"{fn.__name__}: {unknown} is neither a per-token table nor an EstimatorConfig field"
    assert all(isinstance(v, float) for v in entry.metrics(tables).values())


def _rollout(rid: str, gid: str, reward: float, num_segments: int) -> Rollout:
    segs = []
    for k in range(num_segments):
        s = Segment()
        s.append([5, 6])
        s.append([7 + k], generated=True, logprobs=[-1.0], version=0)
        segs.append(s)
    return Rollout(rid, gid, segs, reward)


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp"])
def test_multi_segment_rollout_counts_once(name):
    """A compacted rollout (3 segments) is one sample of its group's baseline; every segment gets its advantage."""
    cfg = OmegaConf.structured(RunConfig(estimator=EstimatorConfig(name=name)))
    groups = [Group("a", {}, [_rollout("a/0", "a", 1.0, 3), _rollout("a/1", "a", 0.0, 1)]),
              Group("b", {}, [_rollout("b/0", "b", 0.0, 1), _rollout("b/1", "b", 0.5, 2)])]
    prep = prepare(groups, cfg)
    expected = compute_advantages(cfg.estimator, [1.0, 0.0, 0.0, 0.5], [0, 0, 1, 1]).tolist()
    assert len(prep.segments) == 7 and prep.helper_targets == {}
    assert prep.advantages == [expected[0]] * 3 + [expected[1], expected[2]] + [expected[3]] * 2
    assert prep.metrics["reward/mean"] == pytest.approx(1.5 / 4)  # per rollout, not per segment


def test_opd_hand_worked():
    student, teacher = torch.tensor([[-1.0, -2.0, 0.0]]), torch.tensor([[-0.5, -3.0, 0.0]])
    adv = opd(torch.zeros(1), torch.zeros(1), student, teacher, torch.tensor([[1.0, 1.0, 0.0]]), opd_coef=2.0)
    assert adv.tolist() == [[1.0, -2.0, 0.0]]  # -2 (-1 + .5), -2 (-2 + 3), padding


def test_gae_hand_worked():
    values = torch.tensor([[0.5, 0.2, 0.1], [0.4, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    rewards = torch.tensor([1.0, 0.0])
    # gamma 1, lam .5: deltas -.3, -.1, .9 -> A = [-.3 + .5 * .35, -.1 + .5 * .9, .9]; rollout 2: 0 - .4
    torch.testing.assert_close(gae_raw(rewards, values, mask, 1.0, 0.5),
                               torch.tensor([[-0.125, 0.35, 0.9], [-0.4, 0, 0]]))
    # gamma .9, lam 1: A_t = discounted return - V_t = [.81 - .5, .9 - .2, 1 - .1]
    torch.testing.assert_close(gae_raw(rewards, values, mask, 0.9, 1.0), torch.tensor([[0.31, 0.7, 0.9], [-0.4, 0, 0]]))
    adv = gae(rewards, torch.zeros(2), values, mask, 1.0, 0.5, eps=0.0)  # whitened over the 4 generated tokens
    raw = torch.tensor([-0.125, 0.35, 0.9, -0.4])
    expected = (raw - raw.mean()) / raw.std(unbiased=False)
    torch.testing.assert_close(adv[mask.bool()], expected)
    assert adv[0, 1:].tolist() == pytest.approx(expected[1:3].tolist()) and adv[1, 1:].tolist() == [0.0, 0.0]


def test_token_table_round_trip_across_segments():
    a, b, c = Segment(), Segment(), Segment()
    a.append([1]), a.append([2, 3], generated=True, logprobs=[-0.1, -0.2]), a.append([4])
    a.append([5], generated=True, logprobs=[-0.3])
    b.append([1, 2]), b.append([6], generated=True, logprobs=[-0.4])  # second segment of the same rollout
    c.append([1]), c.append([7], generated=True, logprobs=[-0.5])
    rollouts = [Rollout("r0", "g", [a, b]), Rollout("r1", "g", [c])]
    table = token_table(rollouts, [s.logprobs for s in (a, b, c)])
    torch.testing.assert_close(table, torch.tensor([[-0.1, -0.2, -0.3, -0.4], [-0.5, 0, 0, 0]]))
    back = untable(rollouts, table * 10)
    assert [pytest.approx(x) for x in back] == [[0, -1, -2, 0, -3], [0, 0, -4], [0, -5]]
    with pytest.raises(AssertionError, match="needs the per-token input 'teacher_logp'"):
        compute_advantages(EstimatorConfig(name="opd"), [0.0, 0.0], [0, 0], mask=table, student_logp=table)
