"""Vision-language policies in the actor: the HF model class, pixels from the segments' images, merged embeddings.

A vision-language model directory (a config with `vision_config`) loads as `AutoModelForImageTextToText`; its
text decoder then runs on packed rows exactly as a text model does, with `inputs_embeds` in place of `input_ids`:
the token embeddings with every image token's row replaced by the image's features (vision tower + connector).
Pixels are recomputed from each image's source bytes by the model's own HF image processor, which is what the
engine ran (tests/agents/test_vision.py checks them equal to the engine's processed image).

Images are consumed in token order: row-major over the packed batch, as the image tokens appear. A segment's
images travel with it (Batch.images, by segment index), so micro-batching and data-parallel sharding keep them.
"""
from __future__ import annotations

import io
import json
from functools import lru_cache
from pathlib import Path

import torch

from molt.types import Batch, Image


def is_vision(model_dir: str | Path) -> bool:
    cfg = Path(model_dir) / "config.json"
    return cfg.exists() and "vision_config" in json.loads(cfg.read_text())


def model_class(model_dir: str | Path):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision(model_dir) else AutoModelForCausalLM


def attach(model, model_dir: str | Path, freeze: bool) -> None:
    """Give a vision-language model its image processor; freeze=True keeps the vision tower and connector fixed."""
    if not is_vision(model_dir):
        return
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(str(model_dir))
    model.molt_pixels = lru_cache(maxsize=256)(lambda sha256, data: _pixels(processor, data))  # by content
    if freeze:
        for name in ("vision_model", "connector"):
            getattr(model.model, name).requires_grad_(False)


def _pixels(processor, data: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    from PIL import Image as PIL

    out = processor(images=[[PIL.open(io.BytesIO(data)).convert("RGB")]], return_tensors="pt")
    return out["pixel_values"][0], out["pixel_attention_mask"][0]  # (tiles, 3, h, w), (tiles, h, w)


def pixels(model, image: Image) -> tuple[torch.Tensor, torch.Tensor]:
    """What the HF image processor makes of one image: pixel values and pixel attention mask."""
    return model.molt_pixels(image.sha256, image.data)


def ordered(batch: Batch) -> list[Image]:
    """The batch's images in the order their tokens appear (row-major); segments are contiguous in a row."""
    out = []
    for row in batch.segment_ids.tolist():
        for seg in dict.fromkeys(s for s in row if s >= 0):  # segments of the row, in order
            out += batch.images.get(seg, [])
    return out


def inputs(model, batch: Batch) -> dict[str, torch.Tensor]:
    """The decoder's token input: input_ids, or (for a batch with images) the merged inputs_embeds."""
    if not batch.images or not hasattr(model, "molt_pixels"):
        assert not batch.images, "the batch has images but the policy is a text model (model.path)"
        return {"input_ids": batch.input_ids}
    ids = batch.input_ids  # (R, T)
    embeds = model.get_input_embeddings()(ids)  # (R, T, H)
    images = ordered(batch)
    if not images:
        return {"inputs_embeds": embeds}
    pv, pm = zip(*(pixels(model, im) for im in images))
    dev = embeds.device
    feats = model.model.get_image_features(torch.cat(pv)[None].to(dev), torch.cat(pm)[None].to(dev)).pooler_output
    is_image = ids == model.config.image_token_id  # (R, T)
    assert int(is_image.sum()) == feats.shape[0] * feats.shape[1], (
        f"{int(is_image.sum())} image tokens in the batch but {feats.shape[0]} images of {feats.shape[1]} features")
    return {"inputs_embeds": embeds.masked_scatter(is_image[..., None], feats.reshape(-1, feats.shape[-1]).to(embeds.dtype))}
