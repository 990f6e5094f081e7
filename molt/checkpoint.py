"""Checkpoints: actor (policy and trainable helpers, each model + optimizer), step, data position and RNG state.

Written atomically (temp file, then rename), so a crash mid-save leaves the previous one intact.
"""
from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch


def save(ckpt_dir: str, step: int, actor_state: dict, data_position: int, keep: int = 2) -> Path:
    d = Path(ckpt_dir)
    d.mkdir(parents=True, exist_ok=True)
    state = {"step": step, "actor": actor_state, "data_position": data_position,
             "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}}
    path = d / f"step_{step:07d}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    for old in sorted(d.glob("step_*.pt"))[:-keep]:
        old.unlink()
    return path


def latest(ckpt_dir: str) -> Path | None:
    found = sorted(Path(ckpt_dir).glob("step_*.pt"))
    return found[-1] if found else None


def load(path: Path) -> dict:
    state = torch.load(path, map_location="cpu", weights_only=False)
    torch.set_rng_state(state["rng"]["torch"])
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])
    return state


def export_hf(path: str | Path, base_model_dir: str | Path, out_dir: str | Path) -> Path:
    """Write a checkpoint's actor as a Hugging Face directory (config and tokenizer from the run's base model),
    e.g. to serve as the teacher of estimator=opd:  python -m molt.checkpoint CKPT BASE_MODEL_DIR OUT_DIR"""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(base_model_dir), dtype=torch.float32)
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=False)["actor"]["policy"]["model"])
    model.save_pretrained(str(out_dir))
    AutoTokenizer.from_pretrained(str(base_model_dir)).save_pretrained(str(out_dir))
    return Path(out_dir)


if __name__ == "__main__":
    import sys

    print(export_hf(*sys.argv[1:4]))
