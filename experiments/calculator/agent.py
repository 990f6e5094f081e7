"""ChatAgent version of the calculator task: an ordinary multi-turn tool-using agent on the `openai` SDK.

Nothing in it knows about Molt except the signature: Molt calls `run_agent(ctx)` once per rollout
with a base URL and key of its loopback server and trains on what the model generated.

    molt agent=chat agent.module=experiments.calculator.agent ...   (full command: README.md)
"""
from __future__ import annotations

import json

from openai import AsyncOpenAI

from experiments.calculator.task import SYSTEM, TOOL, call_tool, reward


async def run_agent(ctx) -> tuple[float, dict]:
    async with AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key) as client:
        messages = [{"role": "system", "content": SYSTEM}] + ctx.messages
        used_tool, text = False, ""
        for _ in range(ctx.max_turns):
            reply = await client.chat.completions.create(model=ctx.model, messages=messages, tools=[TOOL],
                                                         max_tokens=ctx.max_tokens)
            msg = reply.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            if not msg.tool_calls:
                text = msg.content or ""
                break
            for call in msg.tool_calls:
                result, ok = call_tool(call.function.name, json.loads(call.function.arguments))
                used_tool |= ok
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return reward(text, ctx.sample["answer"], used_tool), {"used_tool": float(used_tool)}
