"""Quickstart task "count up": given a digit D, answer the next four digits starting at D
(`Count up from 4:` -> `4567`; 9 wraps to 0: `Count up from 8:` -> `8901`). One turn.

The reward is graded, and computed only from the model's text, so that a random policy already
gets some signal and samples of one group keep differing while it learns (an all-or-nothing
reward gives equal rewards, hence no gradient, far too often). With s = the reply stripped and
t = the 4-digit target, each term in [0, 1]:
    digits   = (digit characters in s) / len(s)
    length   = min(len(s), 4) / max(len(s), 4)
    start    = 1 if s[0] == t[0]                        (copied the digit from the prompt)
    counting = (i in 1..3 with s[i] = s[i-1] + 1 mod 10) / 3
    reward   = (digits + length + start + counting) / 4       (0 for an empty reply)
The terms can be learned one after another: digits and length first, then counting (a
bigram), then copying the start digit from the prompt.

    python -m experiments.quickstart.make_data   # regenerates data/train.jsonl and data/eval.jsonl
"""
from __future__ import annotations

DIGITS = "0123456789"


def target(d: int) -> str:
    return "".join(DIGITS[(d + i) % 10] for i in range(4))


def reward(text: str, answer: str) -> float:
    s = text.strip()
    if not s:
        return 0.0
    digits = sum(c in DIGITS for c in s) / len(s)
    length = min(len(s), 4) / max(len(s), 4)
    start = float(s[0] == answer[0])
    counting = sum(a in DIGITS and b == DIGITS[(DIGITS.index(a) + 1) % 10] for a, b in zip(s[:3], s[1:4])) / 3
    return (digits + length + start + counting) / 4


class CountEnv:
    """No `reset`: the first observation is the sample's `messages`."""

    def __init__(self, sample: dict):
        self.answer = sample["answer"]

    def step(self, action: str) -> tuple[list[dict], float, bool]:
        return [], reward(action, self.answer), True


def make_env(sample: dict) -> CountEnv:
    return CountEnv(sample)
