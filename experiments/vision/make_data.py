"""Write the vision datasets deterministically: train.jsonl (320 rows) and eval.jsonl (40 rows, another seed), each
half red, half blue.

Each image is a 48x48 PNG of one colour, its shade jittered per image, with a grey square (side 8-20, anywhere) that
says nothing, sent as an OpenAI `image_url` data URL (the same rows serve agent=env and agent=chat).

    python -m experiments.vision.make_data [OUT_DIR]   # default: experiments/vision/data
"""
from __future__ import annotations

import base64
import io
import json
import random
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from experiments.vision.task import COLOURS, QUESTION


def image(answer: str, rng: random.Random) -> bytes:
    arr = np.zeros((48, 48, 3)) + np.array(COLOURS[answer]) + [rng.randint(-30, 30) for _ in range(3)]  # one shade
    side = rng.randint(8, 20)
    y, x = rng.randint(0, 48 - side), rng.randint(0, 48 - side)
    arr[y:y + side, x:x + side] = rng.randint(60, 200)  # a grey distractor
    out = io.BytesIO()
    Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)).save(out, "PNG")
    return out.getvalue()


def rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        answer = list(COLOURS)[i % len(COLOURS)]  # every colour equally often: chance is exact
        url = "data:image/png;base64," + base64.b64encode(image(answer, rng)).decode()
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
        out.append({"messages": [{"role": "user", "content": content}], "answer": answer})
    rng.shuffle(out)
    return out


def main(out_dir: str | Path = Path(__file__).parent / "data") -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, n, seed in (("train", 320, 0), ("eval", 40, 1)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(n, seed)))


if __name__ == "__main__":
    main(*sys.argv[1:])
