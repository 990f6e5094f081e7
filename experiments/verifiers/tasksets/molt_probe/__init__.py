"""A verifiers taskset for Molt's tests (tests/agents/test_verifiers.py): a task that runs a command with the bash
harness, and tasks whose scoring fails or is slow. Id `molt_probe` (experiments/verifiers/tasksets on sys.path)."""
import asyncio

import verifiers.v1 as vf
from verifiers.v1.types import content_text


class ProbeData(vf.TaskData):
    kind: str = "file"  # file: reward 1 when the bash tool printed a digit | fail: scoring raises | slow: scoring sleeps


class ProbeTask(vf.Task[ProbeData]):
    @vf.reward(weight=1.0)
    async def tool_output(self, task: ProbeData, trace: vf.Trace) -> float:
        """1 when the bash tool ran a command that printed one digit (the tool's output, as the harness returned it)."""
        if task.kind == "fail":
            raise ValueError("the probe task failed on purpose")
        if task.kind == "slow":
            await asyncio.sleep(30)
        outputs = [content_text(m.content).strip() for m in trace.tool_messages]
        return float(bool(outputs) and outputs[-1].isdigit())


class ProbeTaskset(vf.Taskset[ProbeTask, vf.TasksetConfig]):
    def load(self) -> list[ProbeTask]:
        prompt = "Print one digit with the bash tool."
        return [ProbeTask(ProbeData(prompt=prompt, kind=k), self.config.task) for k in ("file", "fail", "slow")]


__all__ = ["ProbeTaskset"]
