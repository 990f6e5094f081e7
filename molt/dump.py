"""Rollout dumps: `train.dump_rollouts=DIR` appends every step's rollouts to DIR/rollouts.jsonl (the records of
molt/view.py); `train.replay_rollouts=DIR` trains on them again, step by step, without generating (molt/loop.py
`replay`).

    entries = dump.index("outputs/dump")               # (step, byte offset, lines) of every dumped step, in order
    groups, failed = dump.read_step("outputs/dump", entries[0])   # its trained groups and its failed rollouts

A step's records are its trained rollouts, group after group in the order they were trained, then its failed ones. A
run resumed from a checkpoint dumps the steps after that checkpoint again: the later copy of a step is the one the
run's weights came from, so it replaces the earlier one. The records hold what training needs: token ids, loss mask,
behaviour log-probs, weight versions, rewards, group ids (and routed experts); never image pixels, so a dump of a
vision-language run cannot be replayed.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from molt.types import ROUTE_DTYPE, Group, Rollout, Segment

FILE = "rollouts.jsonl"


def path_of(source: str | Path) -> Path:
    """The rollouts file of a dump directory (or the file itself)."""
    source = Path(source)
    return source / FILE if source.is_dir() else source


def append(directory: str | Path, records: list[dict]) -> None:
    Path(directory).mkdir(parents=True, exist_ok=True)
    with open(Path(directory) / FILE, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def index(source: str | Path) -> list[tuple[int, int, int]]:
    """(step, byte offset, number of lines) of every step's block of records, the last copy of each step, in step
    order; one pass that keeps no record (a long run's dump need not fit in memory)."""
    blocks: dict[int, list[int]] = {}
    block, offset = None, 0
    with open(path_of(source), "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break  # the last write of a killed run, cut short
            step = json.loads(line)["step"]
            if block is None or block[0] != step:
                block = blocks[step] = [step, offset, 0]  # a later copy of a step replaces the earlier one
            block[2] += 1
            offset += len(line)
    return [tuple(blocks[s]) for s in sorted(blocks)]


def read_step(source: str | Path, entry: tuple[int, int, int]) -> tuple[list[Group], list[Rollout]]:
    """One step of the dump (an `index` entry): its trained groups, in the order they were trained, and its failed
    rollouts."""
    _, offset, lines = entry
    with open(path_of(source), "rb") as f:
        f.seek(offset)
        records = [json.loads(f.readline()) for _ in range(lines)]
    groups: dict[str, Group] = {}
    failed = []
    for r in records:
        ro = rollout(r)
        if ro.status == "failed":
            failed.append(ro)
        else:
            groups.setdefault(ro.group_id, Group(ro.group_id, {}, index=len(groups))).rollouts.append(ro)
    return list(groups.values()), failed


def rollout(r: dict) -> Rollout:
    return Rollout(r["rollout_id"], r["group_id"], [segment(s) for s in r["segments"]], r["reward"], dict(r["info"]),
                   r["status"], r.get("error", ""))


def segment(s: dict) -> Segment:
    if s.get("images"):
        raise ValueError("train.replay_rollouts: this dump's rollouts hold images, and a dump keeps no pixels (only "
                         "their offsets and hashes): replay works for text-only runs")
    routes = s.get("routed_experts")
    seg = Segment(list(s["token_ids"]), list(s["loss_mask"]), list(s["logprobs"]), list(s["versions"]),
                  None if routes is None else np.asarray(routes, ROUTE_DTYPE))
    seg.check()
    return seg
