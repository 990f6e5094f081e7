"""Grade-school math (GSM8K-style) for the recipes: one turn, reward 1 for the right final number, else 0.

A row is `{"messages": [{"role": "user", "content": <question + format instruction>}], "answer": "72"}`
(written by make_gsm8k.py). The reply's final answer is read as follows:
  1. a thinking block is dropped (everything up to the last `</think>`: Qwen3 thinks by default);
  2. the answer is the number after the last `####`, else the last number in the reply;
  3. thousands separators and a trailing `.0` are ignored, so `1,000` and `1000.0` both match `1000`.
No partial credit: with `rollout.n` samples per question GRPO still sees reward differences within a group
for every question the policy solves sometimes, which is most of GSM8K for a pretrained model.
"""
from __future__ import annotations

import re

INSTRUCTION = "Solve the problem step by step, then give the final answer on its own line as `#### <number>`."
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def normalise(number: str) -> str:
    n = number.replace(",", "").rstrip(".")
    return n[:-2] if n.endswith(".0") else n


def final_answer(text: str) -> str | None:
    """The reply's final number (rules above), or None when it holds none."""
    text = text.rsplit("</think>", 1)[-1]
    if "####" in text:
        found = NUMBER.search(text.rsplit("####", 1)[1])
        return normalise(found.group()) if found else None
    found = NUMBER.findall(text)
    return normalise(found[-1]) if found else None


def reward(text: str, answer: str) -> float:
    return float(final_answer(text) == normalise(answer))


class MathEnv:
    """No `reset`: the first observation is the row's `messages`."""

    def __init__(self, sample: dict):
        self.answer = sample["answer"]

    def step(self, action: str) -> tuple[list[dict], float, bool]:
        return [], reward(action, self.answer), True


def make_env(sample: dict) -> MathEnv:
    return MathEnv(sample)
