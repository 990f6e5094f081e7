"""Env version of the calculator task, for comparison with agent.py: the framework drives the turns.

The first observation is the same system prompt with the same tool section the chat server renders
(`with_tools`), and replies are parsed with the same tool-call parser, so both modes see identical
token sequences for identical generations.

    molt agent.module=experiments.calculator.env agent.max_turns=3 ...   (full command: README.md)
"""
from __future__ import annotations

from experiments.calculator.task import SYSTEM, TOOL, call_tool, reward
from molt.agents.chat_wire import parse_tool_calls, with_tools


class CalculatorEnv:
    def __init__(self, sample: dict):
        self.sample, self.used_tool = sample, False

    def reset(self) -> list[dict]:
        return with_tools([{"role": "system", "content": SYSTEM}] + self.sample["messages"], [TOOL["function"]])

    def step(self, action: str) -> tuple[list[dict], float, bool]:
        text, calls = parse_tool_calls(action)
        if not calls:
            return [], reward(text, self.sample["answer"], used_tool=False), True  # the bonus was paid already
        results = [call_tool(c["name"], c["arguments"]) for c in calls]
        bonus = 0.2 * (not self.used_tool and any(ok for _, ok in results))  # paid once, when first earned
        self.used_tool |= bonus > 0
        return [{"role": "tool", "content": out} for out, _ in results], bonus, False


def make_env(sample: dict) -> CalculatorEnv:
    return CalculatorEnv(sample)
