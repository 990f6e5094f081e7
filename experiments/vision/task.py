"""Vision task "which colour?": the image is a noisy square of one of four colours on a grey ground; the prompt
asks for the colour's number (1 red, 2 green, 3 blue, 4 yellow). Only the image says which: the prompt is the
same for every colour, so a policy that beats 1/4 correct reads the image. One turn, one or two tokens.

Reward, from the model's text only (s = the reply stripped): 1.0 when s is the right digit; 0.25 when s is one of
the four digits but the wrong one; 0 otherwise. The format is learned first (reward ~0.25 -> ~0.44 at chance), then
the colour (up to 1.0): a mean reward of r with every reply a digit means (4r - 1) / 3 correct.

    python -m experiments.vision.make_data    # regenerates data/train.jsonl and data/eval.jsonl
    molt experiment=vision
"""
from __future__ import annotations

COLOURS = {"1": (220, 40, 40), "2": (40, 200, 60), "3": (50, 70, 230), "4": (230, 210, 40)}  # RGB
QUESTION = "Which colour is the square? Answer 1 red, 2 green, 3 blue or 4 yellow:"


def reward(text: str, answer: str) -> float:
    s = text.strip()
    return 1.0 if s == answer else 0.25 if s in COLOURS else 0.0


class ColourEnv:
    """No `reset`: the first observation is the sample's `messages` (the image as a data URL)."""

    def __init__(self, sample: dict):
        self.answer = sample["answer"]

    def step(self, action: str) -> tuple[list[dict], float, bool]:
        return [], reward(action, self.answer), True


def make_env(sample: dict) -> ColourEnv:
    return ColourEnv(sample)
