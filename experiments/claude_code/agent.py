"""Claude Code as the agent of each rollout, on a small file task: "Create a file named hello.txt containing only
the word molt", scored from the directory Claude Code leaves (molt/agents/harness.py runs it).

    make setup                                    # installs the pinned CLIs into harnesses/node_modules (npm)
    molt experiment=claude_code model.path=/path/to/a/long-context/model    (conf/experiment/claude_code.yaml)
"""
from __future__ import annotations

from pathlib import Path

from molt.agents.harness import run_cli


def score(work: Path, name: str, word: str) -> float:
    """1 for the file holding exactly the word, 0.5 for the word among other text, 0.2 for the file alone."""
    path = work / name
    if not path.is_file():
        return 0.0
    text = path.read_text(errors="replace").strip()
    return 1.0 if text == word else 0.5 if word in text else 0.2


async def run_agent(ctx) -> tuple[float, dict]:
    s = ctx.sample
    return await run_cli(ctx, s["messages"][-1]["content"], check=lambda work: score(work, s["file"], s["word"]))
