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
import types
from functools import lru_cache
from pathlib import Path

import torch
from torch.distributed.fsdp import FSDPModule

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

    model.model.inputs_merger = types.MethodType(_merger, model.model)  # instance-level, as parallel.py does
    processor = AutoImageProcessor.from_pretrained(str(model_dir))
    model.molt_pixels = lru_cache(maxsize=256)(lambda sha256, data: _pixels(processor, data))  # by content
    if freeze:
        for name in ("vision_model", "connector"):
            getattr(model.model, name).requires_grad_(False)


def _merger(self, input_ids, inputs_embeds, image_hidden_states):
    """Idefics3Model.inputs_merger at the image spans inputs() set, not at every image token id (a policy may
    generate that id; the engine embeds it as a token)."""
    mask = self.molt_image_mask
    if not mask.any():  # the blank image of a sharded micro-batch without images: run, but contributing nothing
        return inputs_embeds + 0 * image_hidden_states.sum()
    return _merge(inputs_embeds, mask, image_hidden_states)


def _pixels(processor, data: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    from PIL import Image as PIL

    out = processor(images=[[PIL.open(io.BytesIO(data)).convert("RGB")]], return_tensors="pt")
    return out["pixel_values"][0], out["pixel_attention_mask"][0]  # (tiles, 3, h, w), (tiles, h, w)


def pixels(model, image: Image) -> tuple[torch.Tensor, torch.Tensor]:
    """What the HF image processor makes of one image: pixel values and pixel attention mask."""
    return model.molt_pixels(image.sha256, image.data)


def placed(batch: Batch) -> tuple[list[Image], torch.Tensor]:
    """The batch's images in the order their tokens appear (row-major; segments are contiguous in a row) and the
    (R, T) mask of their tokens. From the spans, not the ids: a policy may generate the image token id itself."""
    images, mask = [], torch.zeros(batch.input_ids.shape, dtype=torch.bool)
    for r, row in enumerate(batch.segment_ids.tolist()):
        for seg in dict.fromkeys(s for s in row if s >= 0):  # segments of the row, in order
            start = row.index(seg)
            for im in batch.images.get(seg, []):
                images.append(im)
                mask[r, start + im.offset:start + im.offset + im.length] = True
    return images, mask


def inputs(model, batch: Batch) -> dict[str, torch.Tensor]:
    """The decoder's token input: input_ids, or (for a batch with images) the merged inputs_embeds; for an FSDP
    model the pixels themselves, since FSDP gathers the embeddings and vision tower only in the root's forward
    (parallel._decoder_through_root), where HF merges them (at our mask, see attach) exactly as below."""
    images, mask = placed(batch) if batch.images else ([], None)
    assert not images or hasattr(model, "molt_pixels"), "the batch has images but the policy is a text model"
    ids, sharded = batch.input_ids, isinstance(model, FSDPModule) and hasattr(model, "molt_pixels")  # (R, T)
    if not images and not sharded:
        return {"input_ids": ids}
    if images:
        pv, pm = (torch.cat(x)[None].to(ids.device) for x in zip(*(pixels(model, im) for im in images)))
    else:  # FSDP reduce-scatters only the gradients a backward produced: every rank must run the vision tower in
        # every micro-batch (a padding one too), so a batch without images feeds it one blank image no token uses
        size = model.config.vision_config.image_size
        pv, pm = torch.ones(1, 1, 3, size, size, device=ids.device), torch.ones(1, 1, size, size, device=ids.device)
        mask = torch.zeros(ids.shape, dtype=torch.bool)
    mask = mask.to(ids.device)
    if sharded:
        model.model.molt_image_mask = mask  # read by the merger attach() installs, inside this forward
        return {"input_ids": ids, "pixel_values": pv, "pixel_attention_mask": pm}  # (1, N, 3, h, w), (1, N, h, w)
    feats = model.model.get_image_features(pv, pm).pooler_output  # (N, tokens per image, H)
    return {"inputs_embeds": _merge(model.get_input_embeddings()(ids), mask, feats)}


def _merge(embeds: torch.Tensor, mask: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
    """Token embeddings (R, T, H) with the image tokens' rows (mask (R, T)) replaced by the features, in order."""
    assert int(mask.sum()) == feats.shape[0] * feats.shape[1], (
        f"{int(mask.sum())} image tokens in the batch but {feats.shape[0]} images of {feats.shape[1]} features")
    return embeds.masked_scatter(mask[..., None], feats.reshape(-1, feats.shape[-1]).to(embeds.dtype))
