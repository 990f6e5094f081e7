"""Images in chat messages, for both agent modes: read and check them, have the engine render them, keep them aligned.

An image part is an OpenAI `image_url` part (a data URL, or a local file path under `agent.image_dir`) or an
Anthropic `image` block (`source.type: base64`). Every part is checked here (decodable, an allowed type, within
`agent.image_max_pixels`, at most `agent.image_max_per_prompt` per prompt) and rewritten as a data-URL `image_url`
part, the one form every engine reads. No URL is ever fetched from the network.

Messages with images are rendered by the engine (`/v1/chat/completions/render`, shared/VLM.md), so the prompt ids
with their expanded placeholders and the processed images come from one place. A later observation is rendered as
a delta, the same way env.render_delta does in text: after a dummy conversation whose ids are known, so earlier
turns and their images are never re-rendered. The engine's sampling parameters from render are not used (its
omit-defaults serialisation drops max_tokens=16): every generate call sets its own.
"""
from __future__ import annotations

import base64
import io
import math
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


def has_images(messages: list[dict]) -> bool:
    return any(_is_image(p) for m in messages if isinstance(m.get("content"), list) for p in m["content"])


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

    try:
        with PIL.open(io.BytesIO(data)) as im:
            fmt, (w, h) = im.format, im.size
            im.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise ImageError("unreadable", f"{type(e).__name__}: {e}") from e
    if fmt not in MIME:
        raise ImageError("unsupported_type", f"{fmt}: use one of {sorted(MIME)}")
    if w * h > max_pixels:
        raise ImageError("too_large", f"{w}x{h} = {w * h} pixels > agent.image_max_pixels={max_pixels}")
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
    earlier in the rollout count towards agent.image_max_per_prompt."""
    messages, datas = prepare(messages, cfg)
    if seen + len(datas) > cfg.image_max_per_prompt:
        raise ImageError("too_many", f"{seen + len(datas)} images > agent.image_max_per_prompt={cfg.image_max_per_prompt}")
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


async def render_spliced(router, rollout_id: str, tokenizer, messages: list[dict], spliced: dict[int, list[int]],
                         cfg) -> tuple[list[int], list[Image]]:
    """render() for a rebuilt ChatAgent segment, as env.render_prompt does in text: each earlier reply in `spliced`
    (message index -> the engine's ids) goes to the engine as a unique placeholder, whose ids in the rendering are
    then swapped for the reply's own ids, so model output is never re-encoded from text; content holding
    special-token text is swapped back the same way, encoded with special tokens split. Later images move along."""
    from molt.agents.env import _hold, _splitting

    msgs, held = _hold(tokenizer, messages, spliced)
    ids, ims = await render(router, rollout_id, msgs, cfg)
    for key, h in held.items():
        new = h if isinstance(h, list) else _splitting(tokenizer).encode(h, add_special_tokens=False).ids
        old = tokenizer.encode(key, add_special_tokens=False)
        at = [i for i in range(len(ids) - len(old) + 1) if ids[i:i + len(old)] == old]
        if len(at) != 1:  # the template dropped, repeated or merged it into its neighbours
            raise ValueError(f"the engine's rendering holds the placeholder of an earlier message {len(at)} times, "
                             "not once: this chat template cannot rebuild the conversation from the engine's ids")
        start, end = at[0], at[0] + len(old)
        if isinstance(h, list) and h and h[-1] in tokenizer.added_tokens_decoder and ids[end:end + 1] == h[-1:]:
            end += 1  # the reply ends with the end-of-turn token the template adds after it: once
        ids = ids[:start] + new + ids[end:]
        ims = [im if im.offset < start else replace(im, offset=im.offset + len(new) - (end - start)) for im in ims]
    return ids, ims


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


async def render_delta(router, rollout_id: str, tokenizer, messages: list[dict], last_token_id: int | None, cfg,
                       seen: int) -> tuple[list[int], list[Image]]:
    """env.render_delta for observations with images: what follows a known dummy conversation in the engine's
    rendering of dummy + messages, with the images' offsets moved into the delta."""
    from molt.agents.env import _DUMMY, MARK, TemplateError, _encode

    base = tokenizer.apply_chat_template(_DUMMY, tokenize=False)
    cut = base.rindex(MARK) + len(MARK)
    head, close = _encode(tokenizer, base[:cut]), _encode(tokenizer, base[cut:])
    ids, images = await render(router, rollout_id, _DUMMY + list(messages), cfg, seen)
    if ids[:len(head) + len(close)] != head + close:
        raise TemplateError("the engine's rendering does not extend the dummy conversation token by token; env mode "
                            "with images needs a prefix-stable chat template")
    tail = ids[len(head):]
    if tail and tail[0] == last_token_id and last_token_id in tokenizer.added_tokens_decoder:
        tail = tail[1:]  # the model emitted the end-of-turn token itself
    return tail, shifted(images, len(tail) - len(ids))


def shifted(ims: list[Image], by: int) -> list[Image]:
    return [replace(im, offset=im.offset + by) for im in ims]


def features(ims: list[Image]) -> dict:
    """Images of a prompt (offsets into it) as a generate call's `features` ({} when none, for splatting)."""
    if not ims:
        return {}
    return {"features": {"mm_hashes": {"image": [im.sha256 for im in ims]},
                         "mm_placeholders": {"image": [{"offset": im.offset, "length": im.length} for im in ims]},
                         "kwargs_data": {"image": [im.engine["kwargs_data"] for im in ims]},
                         "mm_metadata": {"image": [im.engine["mm_metadata"] for im in ims]}}}


def detach(seg: Segment) -> None:
    """Drop the engine's processed images: the actor recomputes pixels from the source bytes (README "Images")."""
    seg.images = [replace(im, engine=None) for im in seg.images]


async def engine_features(client, ims: list[Image]) -> dict:
    """`features` for images whose engine payload was dropped (a probe in the driver): the engine renders them again
    from their source bytes, and the same bytes give the same processed image (checked by its hash)."""
    if not ims:
        return {}
    parts = [_data_part(im.data, check(im.data, max_pixels=math.inf)) for im in ims]  # checked once already
    f = (await client.render([{"role": "user", "content": parts}]))["features"]
    assert f["mm_hashes"]["image"] == [im.sha256 for im in ims], "the engine processed the same image differently"
    return features([replace(im, engine={k: f[k]["image"][i] for k in ("kwargs_data", "mm_metadata")})
                     for i, im in enumerate(ims)])


def record(im: Image) -> dict:
    """An image in a rollout dump: where its tokens are, its hash and size; never the pixels."""
    return {"offset": im.offset, "length": im.length, "sha256": im.sha256, "bytes": len(im.data)}
