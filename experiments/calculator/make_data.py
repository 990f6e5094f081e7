"""Write the calculator datasets deterministically: train.jsonl (400 rows), eval.jsonl (40 rows, other phrasings).

    python -m experiments.calculator.make_data [OUT_DIR]   # default: experiments/calculator/data
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

TRAIN_PHRASES = ["What is {a} + {b}?", "Compute {a} + {b}.", "{a} + {b} = ?", "Add {a} and {b}."]
EVAL_PHRASES = ["What do {a} and {b} add up to?", "Sum of {a} and {b}?"]


def rows(phrases: list[str], n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        out.append({"messages": [{"role": "user", "content": rng.choice(phrases).format(a=a, b=b)}],
                    "answer": str(a + b)})
    return out


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "data"
    out.mkdir(parents=True, exist_ok=True)
    for name, phrases, n, seed in [("train", TRAIN_PHRASES, 400, 0), ("eval", EVAL_PHRASES, 40, 1)]:
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(phrases, n, seed)))


if __name__ == "__main__":
    main()
