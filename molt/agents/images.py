"""Images in chat messages, for both agent modes: read and check them, have the engine render them, keep them aligned.

An image part is an OpenAI `image_url` part (a data URL, or a local file path under `agent.image_dir`) or an
Anthropic `image` block (`source.type: base64`). Every part is checked here (decodable, an allowed type, within
`agent.image_max_pixels`, at most `agent.image_max_per_prompt` per prompt) and rewritten as a data-URL `image_url`
part, the one form every engine reads. No URL is ever fetched from the network.

Messages with images are rendered by the engine (`/v1/chat/completions/render`, shared/VLM.md), so the prompt ids
with their expanded placeholders and the processed images come from one place (`render` here; molt/agents/render.py
builds prompts and deltas on it).
"""
from __future__ import annotations

import asyncio
import base64
import io
from dataclasses import replace
from itertools import accumulate, groupby
from pathlib import Path

from molt.types import EngineDied, Image, Segment

MIME = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}


class ImageError(ValueError):
    """A bad image in a rollout's messages: that rollout fails with `reason` counted, the run goes on."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def _is_image(part) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image_url", "image")


def count(messages: list[dict]) -> int:
    return sum(_is_image(p) for m in messages if isinstance(m.get("content"), list) for p in m["content"])


def has_images(messages: list[dict]) -> bool:
    return count(messages) > 0


def _source(part: dict, image_dir: str) -> bytes:
    """The encoded image bytes of one part; never a network fetch."""
    if part["type"] == "image":  # Anthropic
        src = part.get("source") or {}
        if src.get("type") != "base64":
            raise ImageError("unsupported_source", f"image source type {src.get('type')!r}: only base64 is accepted")
        return _b64(src.get("data", ""))
    url = part.get("image_url")
    url = url.get("url", "") if isinstance(url, dict) else str(url or "")
    if url.startswith("data:"):
        head, _, data = url.partition(",")
        if not head.endswith(";base64"):
            raise ImageError("unsupported_source", "a data URL must be base64 (data:image/png;base64,...)")
        return _b64(data)
    path = url.removeprefix("file://")
    if not image_dir or "://" in path or not Path(path).resolve().is_relative_to(Path(image_dir).resolve()):
        raise ImageError("url_not_allowed", f"{url[:80]!r}: images must be data URLs or files under agent.image_dir")
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ImageError("unreadable", f"{url[:80]!r}: {e}") from e


def _b64(data: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except ValueError as e:  # binascii.Error is one
        raise ImageError("unreadable", f"invalid base64: {e}") from e


def check(data: bytes, max_pixels: int) -> str:
    """The MIME type of an encoded image, after checking it decodes, is an allowed type and fits the pixel budget."""
    from PIL import Image as PIL, UnidentifiedImageError

    corrupt = (UnidentifiedImageError, OSError, SyntaxError, ValueError)
    try:
        im = PIL.open(io.BytesIO(data))  # reads the header only: type and size are known before any decoding
    except PIL.DecompressionBombError as e:  # PIL's own bound, hit by a header of over 179 M pixels
        raise ImageError("too_large", str(e)) from e
    except corrupt as e:
        raise ImageError("unreadable", f"{type(e).__name__}: {e}") from e
    with im:
        fmt, (w, h) = im.format, im.size
        if fmt not in MIME:
            raise ImageError("unsupported_type", f"{fmt}: use one of {sorted(MIME)}")
        if w * h > max_pixels:
            raise ImageError("too_large", f"{w}x{h} = {w * h} pixels > agent.image_max_pixels={max_pixels}")
        try:
            im.load()  # the decode, within agent.image_max_pixels
        except corrupt as e:
            raise ImageError("unreadable", f"{type(e).__name__}: {e}") from e
    return MIME[fmt]


def _data_part(data: bytes, mime: str) -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{base64.b64encode(data).decode()}"}}


def prepare(messages: list[dict], cfg) -> tuple[list[dict], list[bytes]]:
    """Messages with every image part as a checked data-URL image_url part, and the images' bytes in order."""
    datas = []

    def checked(part):
        if not _is_image(part):
            return part
        datas.append(_source(part, cfg.image_dir))
        return _data_part(datas[-1], check(datas[-1], cfg.image_max_pixels))

    out = [dict(m, content=[checked(p) for p in m["content"]]) if isinstance(m.get("content"), list) else m
           for m in messages]
    return out, datas


async def render(router, rollout_id: str, messages: list[dict], cfg, seen: int = 0) -> tuple[list[int], list[Image]]:
    """Prompt ids and their images (offsets into those ids), rendered by the rollout's engine; `seen` images
    earlier in the rollout count towards agent.image_max_per_prompt. The images are counted before any is read, and
    read and decoded on a thread: one request's images must not stall the event loop every other rollout shares."""
    n = seen + count(messages)
    if n > cfg.image_max_per_prompt:
        raise ImageError("too_many", f"{n} images > agent.image_max_per_prompt={cfg.image_max_per_prompt}")
    messages, datas = await asyncio.to_thread(prepare, messages, cfg)
    try:
        out = await router.render(rollout_id, messages)
    except EngineDied:
        raise
    except RuntimeError as e:  # the engine rejected the request (HTTP 4xx): a bad input of this rollout
        raise ImageError("rejected", str(e)) from e
    f = out.get("features") or {}
    spans = (f.get("mm_placeholders") or {}).get("image", [])
    if len(spans) != len(datas):
        raise ImageError("lost", f"the engine rendered {len(spans)} of {len(datas)} images")
    ids = list(out["token_ids"])
    images = [Image(*_embedded(ids, s["offset"], s["length"]), sha256=f["mm_hashes"]["image"][i], data=d,
                    engine={k: f[k]["image"][i] for k in ("kwargs_data", "mm_metadata")})
              for i, (s, d) in enumerate(zip(spans, datas))]
    return ids, images


def _embedded(ids: list[int], offset: int, length: int) -> tuple[int, int]:
    """The run of image tokens inside a rendered placeholder span (Idefics3 wraps it in marker tokens), as
    (offset, length). /inference/v1/generate takes placeholders as offset+length only, every token embedded
    (vLLM 0.32 has no is_embed there), so the span given back must be that run; an image processor that splits an
    image into tiles (several runs per image) is refused."""
    ends = list(accumulate(len(list(same)) for _, same in groupby(ids[offset:offset + length])))  # runs of one id
    runs = [(i, j) for i, j in zip([0] + ends, ends) if j - i > 1]
    if len(runs) != 1:
        raise ImageError("unsupported_layout", f"{len(runs)} runs of image tokens in one image's placeholder "
                         f"(image splitting into tiles is not supported: do_image_splitting=false)")
    return offset + runs[0][0], runs[0][1] - runs[0][0]


def shifted(ims: list[Image], by: int) -> list[Image]:
    return [replace(im, offset=im.offset + by) for im in ims]


def detach(seg: Segment) -> None:
    """Drop the engine's processed images: the actor recomputes pixels from the source bytes (README "Images")."""
    seg.images = [replace(im, engine=None) for im in seg.images]
