"""Every recipe (conf/experiment/recipe_*.yaml, found by name: a new one is covered without editing this file) plans
on the cluster it asks for, submits to that many nodes, and is documented; plus the recipes' task (gsm8k.py).

The plan is what `molt experiment=<recipe> dry_run=true` prints, read back from its text: the world size must be
nodes x GPUs per node (every GPU holds one actor rank), the planner's per-GPU total must fit cluster.gpu_memory_gib,
and where the recipe caps the engine (`--gpu-memory-utilization u`: vLLM runs beside the loop on GPUs that also
hold actor ranks) the total must fit the other 1 - u of the GPU as well.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from experiments.recipes.gsm8k import final_answer, reward
from experiments.recipes.make_gsm8k import convert
from molt.cli import main

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("recipe_*.yaml"))
SAMPLE = REPO / "experiments" / "recipes" / "data" / "sample.jsonl"  # hand-written rows: no download in tests
DATA = [f"task.train_path={SAMPLE}", f"task.eval_path={SAMPLE}"]


@pytest.fixture
def molt(monkeypatch, capsys):
    """`molt <overrides>` in this process (a dry run starts nothing; a fresh interpreter per run would cost the
    suite 10-20 s each): what it printed."""
    def run(*overrides: str) -> str:
        monkeypatch.setattr(sys, "argv", ["molt", *overrides, *DATA, "hydra/hydra_logging=none",
                                          "hydra/job_logging=none"])  # leave pytest's logging alone
        main()
        return capsys.readouterr().out
    return run


def plan_problems(text: str) -> list[str]:
    """Why the printed plan does not fit its cluster ([] when it does)."""
    layout = re.search(r"= (\d+) ranks on (\d+) x (\d+) GPUs of ([\d.]+) GiB", text)
    total = re.search(r"total\s+([\d.]+) GiB\s+GPU\s+of [\d.]+ GiB \(cluster.gpu_memory_gib\): (fits|DOES NOT FIT)",
                      text)
    if not (layout and total):
        return ["no GPU memory plan printed (a recipe names its GPUs: cluster.gpus_per_node, cluster.gpu_memory_gib)"]
    world, nodes, gpus, capacity = int(layout[1]), int(layout[2]), int(layout[3]), float(layout[4])
    need, verdict = float(total[1]), total[2]
    problems = []
    if world != nodes * gpus:
        problems.append(f"world size {world} != {nodes} nodes x {gpus} GPUs")
    if need > capacity or verdict != "fits":
        problems.append(f"actor needs {need} GiB per GPU of {capacity} GiB: {verdict}")
    engine = re.search(r"--gpu-memory-utilization ([\d.]+)", text)
    if engine and need > (1 - float(engine[1])) * capacity:
        problems.append(f"actor needs {need} GiB per GPU, but the engine takes {engine[1]} of {capacity} GiB")
    return problems


def test_recipes_are_found():
    assert {"recipe_qwen3_4b", "recipe_qwen3_30b_a3b", "recipe_deepseek_v3_671b"} <= set(RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_fits_its_cluster_and_submits_to_it(recipe, tmp_path, molt):
    plan = molt(f"experiment={recipe}", "dry_run=true", f"hydra.run.dir={tmp_path / 'run'}")
    assert plan_problems(plan) == [], plan
    nodes, gpus = re.search(r"ranks on (\d+) x (\d+) GPUs", plan).groups()
    # the README's command: cluster=slurm keeps the recipe's node count (the overlay sets values, not a cluster)
    sbatch = molt("cluster=slurm", f"experiment={recipe}", "cluster.partition=gpu", "dry_run=true",
                  f"hydra.sweep.dir={tmp_path / 'sweep'}")
    for line in [f"#SBATCH --nodes={nodes}\n", f"#SBATCH --gpus-per-node={gpus}\n", f"#SBATCH --job-name={recipe}\n"]:
        assert line in sbatch, (line, sbatch)
    assert f"experiment={recipe}" in (REPO / "experiments" / "recipes" / "README.md").read_text(), "undocumented"


def test_a_recipe_that_does_not_fit_is_caught(tmp_path, molt):
    """The same recipe on smaller GPUs, one Hydra job each: the planner refuses 20 GiB; 40 GiB holds the actor
    (30 GiB) but not beside the engine's 40%."""
    out = molt("-m", "experiment=recipe_qwen3_4b", "cluster.gpu_memory_gib=20,40", "dry_run=true",
               f"hydra.sweep.dir={tmp_path}")
    small, medium = (plan_problems(plan) for plan in out.split("molt dry run: ")[1:])
    assert len(small) == 2 and "DOES NOT FIT" in small[0] and "the engine takes 0.4" in small[1], out
    assert len(medium) == 1 and "the engine takes 0.4 of 40.0 GiB" in medium[0], out


def test_gsm8k_reward_reads_the_final_number():
    assert reward("<think>maybe 12</think>4 x 12 = 48, 48 - 30 = 18\n#### 18", "18") == 1.0
    assert reward("#### 1,000.", "1000") == 1.0 and reward("so 3.0 in all", "3") == 1.0
    assert reward("#### 17 (not 18)", "18") == 0.0  # the number after the last ####, not the last number
    assert reward("<think>18</think>I am not sure.", "18") == 0.0  # the thinking block does not count
    assert final_answer("no digits here") is None and reward("", "18") == 0.0


def test_gsm8k_rows_become_chat_rows():
    row = convert({"question": "Ann has 3 bags of 4 apples. How many apples? ",
                   "answer": "3 bags * 4 = <<3*4=12>>12 apples.\n#### 12"})
    assert row["answer"] == "12" and row["messages"][0]["role"] == "user"
    assert row["messages"][0]["content"].startswith("Ann has 3 bags of 4 apples. How many apples?\n\n")
    with pytest.raises(ValueError, match="####"):
        convert({"question": "q", "answer": "no final answer"})
