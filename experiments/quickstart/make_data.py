"""Write the quickstart datasets deterministically: train.jsonl (400 rows) and eval.jsonl
(40 rows whose phrasings never occur in training).

    python -m experiments.quickstart.make_data [OUT_DIR]   # default: experiments/quickstart/data
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from experiments.quickstart.task import target

TRAIN_PHRASES = ["Count up from {d}:", "Count up from {d}.", "Count from {d}:", "Count up from the digit {d}:",
                 "Start at {d} and count up:", "Count up, start from {d}:"]
EVAL_PHRASES = ["Please count up from {d}:", "Count four digits up from {d}:"]


def rows(phrases: list[str], n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        d = i % 10  # every digit equally often
        text = rng.choice(phrases).format(d=d)
        out.append({"messages": [{"role": "user", "content": text}], "answer": target(d)})
    rng.shuffle(out)
    return out


def write(path: Path, data: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in data))


def main(out_dir: str | Path = Path(__file__).parent / "data") -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write(out / "train.jsonl", rows(TRAIN_PHRASES, 400, seed=0))
    write(out / "eval.jsonl", rows(EVAL_PHRASES, 40, seed=1))


if __name__ == "__main__":
    main(*sys.argv[1:])
