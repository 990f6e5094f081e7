"""A verifiers taskset (runs in harnesses/verifiers/.venv, not in Molt's venv): the quickstart's "count up" task.

`Count up from 4:` -> `4567`, scored by the quickstart's graded reward (experiments/quickstart/task.py) of the agent's
last reply. Its id is `molt_count`: verifiers imports a taskset by a top-level module name, so the bridge puts
experiments/verifiers/tasksets on its sys.path (agent.verifiers.path in conf/agent/verifiers.yaml).
"""
import json
from pathlib import Path

import verifiers.v1 as vf

from experiments.quickstart.task import reward as count_reward

DATA = Path(__file__).resolve().parents[3] / "quickstart" / "data"


class CountData(vf.TaskData):
    answer: str


class CountTask(vf.Task[CountData]):
    @vf.reward(weight=1.0)
    async def count(self, task: CountData, trace: vf.Trace) -> float:
        return count_reward(trace.last_reply, task.answer)

    @vf.metric
    async def exact(self, task: CountData, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == task.answer)


class CountConfig(vf.TasksetConfig):
    split: str = "train"  # train | eval: experiments/quickstart/data/<split>.jsonl


class CountTaskset(vf.Taskset[CountTask, CountConfig]):
    def load(self) -> list[CountTask]:
        rows = [json.loads(line) for line in (DATA / f"{self.config.split}.jsonl").read_text().splitlines()]
        return [CountTask(CountData(prompt=r["messages"], answer=r["answer"]), self.config.task) for r in rows]


__all__ = ["CountTaskset"]
