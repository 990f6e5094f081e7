"""Vision task "red or blue?": the image is one colour, red or blue (its shade jittered, a grey square somewhere);
the prompt asks for a low digit (0-4) for red and a high one (5-9) for blue. Only the image says which: the prompt
is the same for every image, so a policy that beats chance reads the image. One turn of a few tokens.

Reward, from the model's text only: 1.0 if the reply's first digit is in the image's half (0-4 red, 5-9 blue), else
0.0 (no digit, or the other half). Why halves, not one digit per colour: a random policy starts a reply with a right
digit in 1% of its tokens (5 of the 512 in the vocabulary, not 1), so even from scratch a few of every step's 64
replies earn a reward, and a group always rewards its right digits over its wrong ones: the colour is learned with
the format, not after it. Chance: a policy that does not look at the image is in the right half on at most half of a
balanced set (whatever its digits), so it earns at most 0.5; reading the image earns 1.0.

    python -m experiments.vision.make_data    # regenerates data/train.jsonl and data/eval.jsonl
    molt experiment=vision
"""
from __future__ import annotations

COLOURS = {"red": (220, 40, 40), "blue": (50, 70, 230)}  # RGB
HALVES = {"red": "01234", "blue": "56789"}
QUESTION = "Is the picture red or blue? Answer with one digit, 0-4 for red, 5-9 for blue:"
CHANCE = 0.5  # the most an image-blind policy earns on a balanced set


def reward(text: str, answer: str) -> float:
    digit = next((c for c in text if c in "0123456789"), None)
    return float(digit is not None and digit in HALVES[answer])


class ColourEnv:
    """No `reset`: the first observation is the sample's `messages` (the image as a data URL)."""

    def __init__(self, sample: dict):
        self.answer = sample["answer"]

    def step(self, action: str) -> tuple[list[dict], float, bool]:
        return [], reward(action, self.answer), True


def make_env(sample: dict) -> ColourEnv:
    return ColourEnv(sample)
