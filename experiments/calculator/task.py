"""Calculator task, shared by the ChatAgent version (agent.py) and the Env version (env.py).

A question "What is 23 + 58?" has a numeric answer. The policy may call one tool, `calculator`,
with an arithmetic expression, and then answers. The reward is graded and computed from the final
reply text only (so a random policy already gets some signal, and samples keep differing while it
learns), plus a bonus for a tool call that evaluated. With s = the final reply stripped and a = the
answer, each term in [0, 1]:
    digits = (digit characters in s) / len(s)
    length = min(len(s), len(a)) / max(len(s), len(a))
    close  = max(0, 1 - |int(p) - int(a)| / 10)      p = s[:len(a)], the reply's start (0 unless digits)
    answer = (digits + length + 2 * close) / 4      (1 for the exact answer, 0 for an empty reply)
    reward = 0.8 * answer + 0.2 * used_tool
"""
from __future__ import annotations

import ast
import operator

TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "Integer arithmetic, e.g. 23 + 58",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
SYSTEM = "Answer with the number only."
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """Integer arithmetic (+ - * // %), parentheses; anything else is an error message, not an exception."""
    def ev(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression: {expression!r}")
    try:
        return str(ev(ast.parse(str(expression)[:100], mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
        return f"error: {e}"


def call_tool(name: str, arguments) -> tuple[str, bool]:
    """(result text, whether the call evaluated)."""
    if name != "calculator" or not isinstance(arguments, dict):
        return f"error: unknown tool {name!r}", False
    out = calculate(arguments.get("expression", ""))
    return out, not out.startswith("error")


def answer_score(text: str, answer: str) -> float:
    s = text.strip()
    if not s:
        return 0.0
    digits = sum(c.isdigit() for c in s) / len(s)
    length = min(len(s), len(answer)) / max(len(s), len(answer))
    head = s[:len(answer)]  # graded on the reply's start: a reply that goes on past the answer still learns it
    close = max(0.0, 1 - abs(int(head) - int(answer)) / 10) if head.isdigit() else 0.0
    return (digits + length + 2 * close) / 4


def reward(text: str, answer: str, used_tool: bool) -> float:
    return 0.8 * answer_score(text, answer) + 0.2 * float(used_tool)
