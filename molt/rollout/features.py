"""Images as the engine takes them: a prompt's images as a generate call's `features`, and those features made again
by the engine from the images' source bytes (for a probe in the driver, which holds no engine payload)."""
from __future__ import annotations

import base64
import io
from dataclasses import replace

from molt.rollout.engine import EngineClient
from molt.types import Image


def image_features(ims: list[Image]) -> dict:
    """Images of a prompt (offsets into it) as a generate call's `features` ({} when none, for splatting)."""
    if not ims:
        return {}
    return {"features": {"mm_hashes": {"image": [im.sha256 for im in ims]},
                         "mm_placeholders": {"image": [{"offset": im.offset, "length": im.length} for im in ims]},
                         "kwargs_data": {"image": [im.engine["kwargs_data"] for im in ims]},
                         "mm_metadata": {"image": [im.engine["mm_metadata"] for im in ims]}}}


async def engine_features(client: EngineClient, ims: list[Image]) -> dict:
    """`features` for images whose engine payload was dropped (a probe in the driver): the engine renders them again
    from their source bytes, and the same bytes give the same processed image (checked by its hash)."""
    if not ims:
        return {}
    from PIL import Image as PIL

    def part(data: bytes) -> dict:
        with PIL.open(io.BytesIO(data)) as im:  # a type molt/agents/images.py accepted when the rollout ran
            url = f"data:{PIL.MIME[im.format]};base64,{base64.b64encode(data).decode()}"
        return {"type": "image_url", "image_url": {"url": url}}

    f = (await client.render([{"role": "user", "content": [part(im.data) for im in ims]}]))["features"]
    assert f["mm_hashes"]["image"] == [im.sha256 for im in ims], "the engine processed the same image differently"
    return image_features([replace(im, engine={k: f[k]["image"][i] for k in ("kwargs_data", "mm_metadata")})
                           for i, im in enumerate(ims)])
