"""Codex CLI as the agent of each rollout, on a small file task: fix a misspelt word in a file the task provides,
scored from the directory Codex leaves (molt/agents/harness.py runs it).

    make setup                                    # installs the pinned CLIs into harnesses/node_modules (npm)
    molt experiment=codex model.path=/path/to/a/long-context/model          (conf/experiment/codex.yaml)
"""
from __future__ import annotations

from pathlib import Path

from molt.agents.harness import run_cli


def score(work: Path, sample: dict) -> float:
    """1 for exactly the fixed text, 0.5 for the misspelling gone but other changes, 0 otherwise."""
    path = work / sample["file"]
    text = path.read_text(errors="replace") if path.is_file() else sample["wrong"]
    if text == sample["text"].replace(sample["wrong"], sample["right"]):
        return 1.0
    return 0.5 if sample["wrong"] not in text and sample["right"] in text else 0.0


async def run_agent(ctx) -> tuple[float, dict]:
    s = ctx.sample
    return await run_cli(ctx, s["messages"][-1]["content"], check=lambda work: score(work, s),
                         files={s["file"]: s["text"]})
