"""Sticky, least-loaded routing. Two clients with different names share one real server: placement
is decided by the router from its own bookkeeping, so one server tests the logic honestly."""
import asyncio

import pytest

from molt.net import free_port
from molt.rollout.engine import EngineClient
from molt.rollout.router import Router
from molt.types import EngineDied
from tests.rollout.conftest import run

PROMPT = [1, 17, 42, 99, 7]


def test_least_loaded_then_sticky(engine):
    async def main():
        key = engine.api_key
        router = Router([EngineClient("a", engine.url, api_key=key), EngineClient("b", engine.url, api_key=key)])

        def start(rollout_id, n=64):
            return asyncio.create_task(router.generate(rollout_id, PROMPT, n, temperature=1.0))

        first = [start("r0"), start("r1"), start("r2")]
        await asyncio.sleep(0)  # each task has placed its request and is awaiting the engine
        placed = (router.load(), dict(router.assigned))
        # r1 is stuck to b even though a now has fewer requests in flight than b
        more = [start("r1"), start("r1")]
        await asyncio.sleep(0)
        busy_b = router.load()
        outs = await asyncio.gather(*first, *more)
        idle = router.load()
        router.release("r1")
        again = start("r1", 4)  # placed afresh: a and b are idle, b now holds fewer rollouts
        await asyncio.sleep(0)
        replaced = router.assigned["r1"]
        await again
        return placed, busy_b, outs, idle, replaced

    placed, busy_b, outs, idle, replaced = run(main())
    assert placed == ({"a": 2, "b": 1}, {"r0": "a", "r1": "b", "r2": "a"})
    assert busy_b == {"a": 2, "b": 3}
    assert all(0 < len(o.token_ids) == len(o.logprobs) <= 64 and o.finish_reason in ("stop", "length") for o in outs)
    assert idle == {"a": 0, "b": 0}
    assert replaced == "b"


def test_dead_engine_frees_its_slot():
    router = Router([EngineClient("gone", f"http://127.0.0.1:{free_port()}", 5.0)])
    with pytest.raises(EngineDied, match="gone"):
        run(router.generate("r0", PROMPT, 4))
    assert router.load() == {"gone": 0} and router.assigned == {"r0": "gone"}
    router.release("r0")
    assert router.assigned == {} and router.rollouts == {"gone": 0}


def test_identical_requests_in_one_tick_share_one_engine_request(engine):
    async def main():
        client = EngineClient("a", engine.url, api_key=engine.api_key)
        calls = []
        real = client.generate_n

        async def counted(ids, max_tokens, n, **kw):
            calls.append((tuple(ids), n))
            return await real(ids, max_tokens, n, **kw)

        client.generate_n = counted
        router = Router([client])
        same = [router.generate(f"g/{i}", PROMPT, 8, temperature=1.0) for i in range(8)]
        other = router.generate("h/0", PROMPT + [5], 8, temperature=1.0)
        outs = await asyncio.gather(*same, other)
        return calls, outs, router.load()

    calls, outs, load = run(main())
    assert sorted(calls) == [(tuple(PROMPT), 8), (tuple(PROMPT + [5]), 1)]
    assert len({tuple(o.token_ids) for o in outs[:8]}) > 1, "n independent samples, not one copied"
    assert all(len(o.token_ids) == len(o.logprobs) > 0 for o in outs) and load == {"a": 0}


def test_seeded_samples_are_the_same_coalesced_or_alone(engine):
    """rollout.seed: sample i of a coalesced request draws what rollout i draws alone (vLLM seeds sample k with
    seed + k); the next turn and another group draw afresh."""
    async def main():
        key = engine.api_key
        together = Router([EngineClient("a", engine.url, api_key=key)], seed=11)
        batch = await asyncio.gather(*(together.generate(f"g1/{i}", PROMPT, 12, temperature=1.0) for i in range(4)))
        second_turn = await together.generate("g1/0", PROMPT, 12, temperature=1.0)
        alone = Router([EngineClient("b", engine.url, api_key=key)], seed=11)
        singles = [await alone.generate(f"g1/{i}", PROMPT, 12, temperature=1.0) for i in (3, 1, 0, 2)]
        other_group = await alone.generate("g2/0", PROMPT, 12, temperature=1.0)
        return batch, second_turn, singles, other_group

    batch, second_turn, singles, other_group = run(main())
    ids = [o.token_ids for o in batch]
    assert len({tuple(t) for t in ids}) == 4, "four different samples"
    assert [o.token_ids for o in singles] == [ids[3], ids[1], ids[0], ids[2]]
    assert all(abs(a - b) < 1e-5 for o, s in zip(batch, [singles[2], singles[1], singles[3], singles[0]])
               for a, b in zip(o.logprobs, s.logprobs))
    assert second_turn.token_ids != ids[0] and other_group.token_ids != ids[0]


def test_requests_wait_for_the_replacement_of_a_dead_engine(engine):
    """With on_down, an engine's failure is reported once per incarnation; later requests wait for up(name)."""
    async def main():
        reports = []
        client = EngineClient("x", f"http://127.0.0.1:{free_port()}", 5.0)
        router = Router([client], on_down=lambda name, epoch: reports.append((name, epoch)))
        with pytest.raises(EngineDied):
            await router.generate("r0", PROMPT, 4)
        waiting = asyncio.create_task(router.generate("r1", PROMPT, 4))
        await asyncio.sleep(1.0)
        held = not waiting.done()
        client.url, client.api_key = engine.url, engine.api_key  # the replacement, at the same name
        await router.up("x")
        out = await asyncio.wait_for(waiting, 60)
        return reports, held, out, router.epoch

    reports, held, out, epoch = run(main())
    assert reports == [("x", 0)] and held and len(out.token_ids) > 0 and epoch == {"x": 1}


def test_without_stickiness_each_request_goes_to_the_least_loaded(engine):
    """rollout.sticky=false (the baseline of the prefix-cache benchmark): a rollout's requests spread over engines."""
    async def main():
        key = engine.api_key
        router = Router([EngineClient("a", engine.url, api_key=key), EngineClient("b", engine.url, api_key=key)],
                        sticky=False)
        tasks = [asyncio.create_task(router.generate("r0", PROMPT + [i], 8, temperature=1.0)) for i in range(2)]
        await asyncio.sleep(0)
        placed = (router.load(), dict(router.assigned))
        await asyncio.gather(*tasks)
        return placed

    assert run(main()) == ({"a": 1, "b": 1}, {})
