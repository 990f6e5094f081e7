"""Rollout dumps read back (molt/dump.py): what the loop writes (molt/view.py records) is what replay trains on."""
import numpy as np

from molt import dump, view
from molt.types import Group, Rollout, Segment


def step_groups(step: int) -> tuple[list[Group], list[Rollout], list[float]]:
    """Two groups of two rollouts (one of them in two segments, the second with routed experts), a failed rollout,
    and the advantage of every trained segment."""
    groups, advantages = [], []
    for g in range(2):
        rollouts = []
        for i in range(2):
            seg = Segment()
            seg.append([1, 2, 3 + g])
            seg.append([7 + i, 8], generated=True, logprobs=[-0.5 - i, -0.25], version=step)
            segs = [seg]
            if (g, i) == (0, 0):  # compacted context: a second segment, with routes
                more = Segment()
                more.append([4], generated=False)
                more.append([9], generated=True, logprobs=[-1.0], version=step)
                more.routed_experts = np.arange(2 * 3 * 2, dtype=np.int32).reshape(2, 3, 2)
                segs.append(more)
            rollouts.append(Rollout(f"g{step}{g}/{i}", f"g{step}{g}", segs, reward=0.25 * (g + i) + step))
        groups.append(Group(f"g{step}{g}", {}, rollouts, index=g))
        advantages += [0.5] * sum(len(r.segments) for r in rollouts)
    failed = [Rollout(f"g{step}9/0", f"g{step}9", [], status="failed", error="boom")]
    return groups, failed, advantages


def write_step(directory, step: int, reward_shift: float = 0.0):
    groups, failed, advantages = step_groups(step)
    for r in (r for g in groups for r in g.rollouts):
        r.reward += reward_shift
    dump.append(directory, view.records(groups, failed, advantages, step))
    return groups


def test_a_dump_reads_back_step_by_step_with_the_last_copy_of_a_repeated_step(tmp_path):
    """Steps 0-2 dumped, then a resumed run dumps 1-2 again (other rewards) and is killed mid-write: the index has
    steps 0, 1, 2 once each, the later copies; every column, reward, group and status reads back as written."""
    written = [write_step(tmp_path, s) for s in range(3)]
    resumed = [write_step(tmp_path, s, reward_shift=10.0) for s in (1, 2)]
    with open(tmp_path / dump.FILE, "a") as f:
        f.write('{"step": 3, "group_id": "g3')  # a kill in the middle of a write
    entries = dump.index(tmp_path)
    assert [e[0] for e in entries] == [0, 1, 2]
    for entry, want in zip(entries, [written[0], *resumed]):
        groups, failed = dump.read_step(tmp_path, entry)
        assert [g.group_id for g in groups] == [g.group_id for g in want]
        assert [f.status for f in failed] == ["failed"] and failed[0].error == "boom"
        for g, w in zip(groups, want):
            assert [(r.rollout_id, r.reward, r.status) for r in g.rollouts] == \
                   [(r.rollout_id, r.reward, r.status) for r in w.rollouts]
            for r, wr in zip(g.rollouts, w.rollouts):
                assert len(r.segments) == len(wr.segments)
                for s, ws in zip(r.segments, wr.segments):
                    assert (s.token_ids, s.loss_mask, s.logprobs, s.versions) == \
                           (ws.token_ids, ws.loss_mask, ws.logprobs, ws.versions)
                    assert (s.routed_experts is None) == (ws.routed_experts is None)
                    assert s.routed_experts is None or np.array_equal(s.routed_experts, ws.routed_experts)
