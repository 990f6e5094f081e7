"""The calculator example's task logic (no engine; the SDK agent and the Env are run in test_chat.py)."""
import pytest

from experiments.calculator.env import make_env
from experiments.calculator.task import answer_score, calculate, call_tool, reward

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "23 + 58"}}\n</tool_call>'
SAMPLE = {"messages": [{"role": "user", "content": "What is 23 + 58?"}], "answer": "81"}


@pytest.mark.parametrize("expr, out", [("23 + 58", "81"), ("(2 + 3) * 4 - 1", "19"), ("-7 // 2", "-4"), ("9 % 4", "1"),
                                       ("2 ** 100", "error"), ("__import__('os')", "error"), ("1 / 0", "error"),
                                       ("1 // 0", "error"), ("2.5 + 1", "error"), ("", "error")])
def test_calculate_is_integer_arithmetic_only(expr, out):
    assert calculate(expr).startswith(out) and (out == "error") == calculate(expr).startswith("error")


@pytest.mark.parametrize("text, expected", [
    ("81", 1.0), (" 81\n", 1.0), ("80", (1 + 1 + 2 * 0.9) / 4), ("91", (1 + 1 + 0) / 4), ("79", (1 + 1 + 2 * 0.8) / 4),
    ("8", (1 + 0.5 + 0) / 4), ("8123", (1 + 0.5 + 2) / 4), ("7712", (1 + 0.5 + 2 * 0.6) / 4),
    ("81!", (2 / 3 + 2 / 3 + 2) / 4), ("8x1", (2 / 3 + 2 / 3 + 0) / 4), ("", 0.0), ("abc", (0 + 2 / 3 + 0) / 4)])
def test_answer_score_hand_worked(text, expected):
    assert answer_score(text, "81") == pytest.approx(expected)


def test_reward_and_tool_bonus():
    assert reward("81", "81", True) == pytest.approx(1.0) and reward("81", "81", False) == pytest.approx(0.8)
    assert call_tool("calculator", {"expression": "1+1"}) == ("2", True)
    assert call_tool("calculator", {"expression": "x"})[1] is False and call_tool("other", {})[1] is False


def test_env_pays_the_same_reward_as_the_agent():
    env = make_env(SAMPLE)
    assert env.reset()[0]["content"].startswith("Answer with the number only.\n\n# Tools")
    obs, r1, done = env.step("Let me compute.\n" + CALL)
    assert (obs, r1, done) == ([{"role": "tool", "content": "81"}], pytest.approx(0.2), False)
    obs, r2, done = env.step(CALL)  # a second call earns no second bonus
    assert (r2, done) == (0.0, False)
    obs, r3, done = env.step("81")
    assert (obs, done) == ([], True) and r1 + r2 + r3 == pytest.approx(reward("81", "81", True))
    assert make_env(SAMPLE).step("<tool_call>{broken</tool_call>") == ([], reward(
        "<tool_call>{broken</tool_call>", "81", False), True)
