"""Dynamic batch filtering in `collect`: constant groups are dropped, their credit returns at once, the batch fills
from the queue, and a task where every group is constant stops the run. The queue is a real Queue; the worker is a
list that records the credits refunded."""
import queue

import pytest
from omegaconf import OmegaConf

from molt.config import FilterConfig, RunConfig
from molt.loop import collect, rollout_metrics
from molt.types import Group, Rollout, Segment


def group(i: int, rewards: list[float], version: int = 0, failed: int = 0) -> Group:
    rollouts = []
    for k, r in enumerate(rewards):
        s = Segment()
        s.append([1, 2])
        s.append([3], generated=True, logprobs=[-0.5], version=version)
        rollouts.append(Rollout(f"g{i}/{k}", f"g{i}", [s], r, status="failed" if k < failed else "ok"))
    return Group(f"g{i}", {}, rollouts, index=i, timing=(0.0, 1.0))


def run_collect(groups, enabled=True, groups_per_step=2, factor=10.0, version=0):
    cfg = OmegaConf.structured(RunConfig(filter=FilterConfig(enabled=enabled, max_drop_factor=factor)))
    cfg.train.groups_per_step, cfg.rollout.n = groups_per_step, 3
    q, granted = queue.Queue(), []
    for g in groups:
        q.put(("group", g))
    kept, counts = collect(lambda: q.get(timeout=1), cfg, version, refund=granted.append)
    return kept, counts, granted, q.qsize()


def test_constant_groups_are_dropped_and_the_batch_fills_up():
    groups = [group(0, [1.0, 1.0, 1.0]), group(1, [0.0, 1.0, 1.0]), group(2, [0.5, 0.5, 0.5]),
              group(3, [0.2, 0.2, 0.3]), group(4, [1.0, 0.0, 0.0])]
    kept, counts, granted, left = run_collect(groups)
    assert [g.group_id for g in kept] == ["g1", "g3"] and left == 1  # g4 stays queued for the next step
    assert counts["filtered"] == 2 and granted == [1, 1]  # each dropped group's credit went back at once
    metrics = rollout_metrics(kept, counts, 1)
    assert metrics["filter/dropped"] == 2 and metrics["filter/dropped_frac"] == pytest.approx(2 / 4)


def test_filter_disabled_keeps_constant_groups():
    kept, counts, granted, _ = run_collect([group(0, [1.0, 1.0, 1.0]), group(1, [0.0, 0.0, 0.0])], enabled=False)
    assert len(kept) == 2 and counts["filtered"] == 0 and granted == []


def test_equality_is_over_the_rollouts_that_did_not_fail():
    """[0 (failed), 1, 1]: the surviving rollouts are constant, so the group is dropped."""
    kept, counts, _, _ = run_collect([group(0, [0.0, 1.0, 1.0], failed=1), group(1, [0.0, 1.0, 1.0]),
                                      group(2, [0.0, 1.0, 0.0])])
    assert [g.group_id for g in kept] == ["g1", "g2"] and counts["filtered"] == 1 and counts["failed"] == 1


def test_a_task_with_only_constant_groups_fails_loudly():
    groups = [group(i, [0.25] * 3) for i in range(10)]
    with pytest.raises(RuntimeError, match=r"filter\.enabled: 5 groups .* = 4\): .*filter\.max_drop_factor"):
        run_collect(groups, groups_per_step=2, factor=2.0)
