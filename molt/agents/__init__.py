"""Agent modes, by `agent.mode`: what the user's `agent.module` must define, and the runner of one prompt group.

Adding a mode = one runner (`run_group(generate, tokenizer, agent, sample, group_id, n, agent_cfg, sampling,
release) -> Group`) and one `MODES` entry.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from molt.agents.chat_agent import run_chat_group
from molt.agents.env import run_group


@dataclass(frozen=True)
class Mode:
    entry: str  # the callable agent.module must define
    run_group: Callable
    contract: str  # where the contract of `entry` is written down


MODES = {"env": Mode("make_env", run_group, "molt/agents/env.py"),
         "chat": Mode("run_agent", run_chat_group, "molt/agents/chat_agent.py")}


def load_agent(mode: str, module: Any) -> Callable:
    """The entry point of an imported agent.module, checked (for the rollout pool and the guard rails)."""
    m = MODES[mode]
    fn = getattr(module, m.entry, None)
    if not callable(fn):
        raise AttributeError(f"agent.mode={mode} needs agent.module={module.__name__} to define {m.entry} "
                             f"(see {m.contract} and the README's agent sections)")
    return fn
