"""One OpenAI Agents SDK episode with an `add` tool, run as a process in the SDK's own venv (harnesses/openai-agents:
openai-agents 0.24.0 needs websockets<17, requirements.lock pins 17.4). tests/agents/test_libraries.py starts it:

    harnesses/openai-agents/.venv/bin/python tests/agents/openai_agents_episode.py BASE_URL KEY MODEL responses|chat

It prints one JSON line: the run's final output, the tool's arguments, the SDK version and every connection or name
lookup that was not to loopback (`offline` refuses them; the test module uses the same guard).
"""
import asyncio
import contextlib
import json
import socket
import sys

LOOPBACK = ("127.", "::1", "localhost")


@contextlib.contextmanager
def offline():
    """Refuse, and list, every connection or name lookup that is not to loopback (nothing may go to the network)."""
    tried, connect, getaddrinfo = [], socket.socket.connect, socket.getaddrinfo

    def guarded(host):
        if not str(host).startswith(LOOPBACK):
            tried.append(str(host))
            raise OSError(f"offline: refused {host}")

    def connect_(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            guarded(address[0])
        return connect(sock, address)

    def getaddrinfo_(host, *a, **kw):
        guarded(host)
        return getaddrinfo(host, *a, **kw)

    socket.socket.connect, socket.getaddrinfo = connect_, getaddrinfo_
    try:
        yield tried
    finally:
        socket.socket.connect, socket.getaddrinfo = connect, getaddrinfo


async def episode(base_url: str, key: str, model: str, api: str) -> dict:
    import openai
    from agents import (Agent, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, __version__, function_tool,
                        set_tracing_disabled)

    set_tracing_disabled(True)
    ran = []

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two digits."""
        ran.append([a, b])
        return a + b

    client = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0)
    kind = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    agent = Agent(name="adder", instructions="You add.", tools=[add], model=kind(model=model, openai_client=client))
    result = await Runner.run(agent, "What is 2 plus 3?", max_turns=3)
    return {"final": result.final_output, "ran": ran, "version": __version__}


if __name__ == "__main__":
    with offline() as tried:
        out = asyncio.run(episode(*sys.argv[1:5]))
    print(json.dumps(out | {"tried": tried}))
