"""Suite-wide test options.

MOLT_TEST_REVERSE=1 runs the collected tests in reverse order, to show that no test depends on what an earlier one
left behind in a shared fixture (the rollout tests share one engine):
    MOLT_TEST_REVERSE=1 .venv/bin/python -m pytest tests/rollout
"""
import os


def pytest_collection_modifyitems(items):
    if os.environ.get("MOLT_TEST_REVERSE") == "1":
        items.reverse()
