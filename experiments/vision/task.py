"""Vision task "which colour?": the image is a square of one of four colours (its shade jittered) on a grey ground; the prompt
asks for the colour's number (1 red, 2 green, 3 blue, 4 yellow). Only the image says which: the prompt is the
same for every colour, so a policy that beats 1/4 correct reads the image. One turn, one or two tokens.

Reward, from the model's text only, graded so that a random policy already gets some signal (s = the reply
stripped, d = its first character among 1-4):
    0.25 if s holds a digit 1-4 at all, + 0.25 if s is exactly one such digit, + 0.5 if d is the right one.
So a policy that answers one digit at random earns 0.625; reading the image correctly earns 1.0.

    python -m experiments.vision.make_data    # regenerates data/train.jsonl and data/eval.jsonl
    molt experiment=vision
"""
from __future__ import annotations

COLOURS = {"1": (220, 40, 40), "2": (40, 200, 60), "3": (50, 70, 230), "4": (230, 210, 40)}  # RGB
QUESTION = "Which colour is the square? Answer 1 red, 2 green, 3 blue or 4 yellow:"


def reward(text: str, answer: str) -> float:
    s = text.strip()
    digits = [c for c in s if c in COLOURS]
    if not digits:
        return 0.0
    return 0.25 + 0.25 * (s in COLOURS) + 0.5 * (digits[0] == answer)


class ColourEnv:
    """No `reset`: the first observation is the sample's `messages` (the image as a data URL)."""

    def __init__(self, sample: dict):
        self.answer = sample["answer"]

    def step(self, action: str) -> tuple[list[dict], float, bool]:
        return [], reward(action, self.answer), True


def make_env(sample: dict) -> ColourEnv:
    return ColourEnv(sample)
