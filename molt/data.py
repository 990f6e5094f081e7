"""Chat-template datasets: JSONL, one object per line with `messages` (the first observation,
a list of `{role, content}` chat messages) plus any task fields (e.g. `answer`).

The same file serves Env mode and ChatAgent mode. `DataStream` draws rows in endless shuffled
epochs, deterministically from a seed, so a resumed run continues exactly where it stopped.
"""
from __future__ import annotations

import json
import random
from pathlib import Path


def _check_row(row, where: str) -> dict:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    msgs = row.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ValueError(f"{where}: `messages` must be a non-empty list of chat messages")
    for m in msgs:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), (str, list))):
            raise ValueError(f"{where}: each message needs a string `role` and a `content` (string or parts): {m!r}")
    return row


def load_jsonl(path: str | Path) -> list[dict]:
    """Read and validate a dataset; a bad line raises ValueError naming `path:line` (1-based)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
            rows.append(_check_row(row, where))
    if not rows:
        raise ValueError(f"{path}: dataset is empty (set task.train_path / task.eval_path to a JSONL file with rows)")
    return rows


class DataStream:
    """Endless shuffled epochs over `rows`. Draw `position` p is row `perm(epoch)[p % len]`
    with `epoch = p // len`, a pure function of (seed, p): resuming only needs `position`."""

    def __init__(self, rows: list[dict], seed: int = 0):
        assert rows, "DataStream needs at least one row"
        self.rows, self.seed, self.position = rows, seed, 0
        self._epoch, self._order = -1, []

    def _perm(self, epoch: int) -> list[int]:
        if epoch != self._epoch:  # one shuffle per epoch, cached
            self._order = list(range(len(self.rows)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(self._order)
            self._epoch = epoch
        return self._order

    def next(self) -> tuple[int, dict]:
        """(position of this draw, row). `skip_to(position)` later redraws the same row."""
        p = self.position
        epoch, i = divmod(p, len(self.rows))
        self.position += 1
        return p, self.rows[self._perm(epoch)[i]]

    def skip_to(self, position: int) -> None:
        assert position >= 0, f"stream position must be >= 0, got {position}"
        self.position = position
