"""Every config file composes against the dataclass schemas; typos are rejected; `molt --cfg job` prints the run."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from molt.config import REPO, register

CONF = REPO / "conf"
GROUP_FILES = sorted(p.relative_to(CONF) for p in CONF.glob("*/*.yaml"))  # a new file is covered automatically


def compose(*overrides: str, conf: Path = CONF):
    register()
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        return hydra_compose("config", overrides=list(overrides))


def test_group_files_are_found():
    groups = {p.parent.name for p in GROUP_FILES}
    assert {"model", "fsdp", "estimator", "agent", "engine", "cluster", "task", "experiment"} <= groups


@pytest.mark.parametrize("path", GROUP_FILES, ids=str)
def test_every_group_file_composes(path):
    cfg = compose(f"{path.parent.name}={path.stem}")
    if path.parent.name == "model":
        assert cfg.model.name == path.stem and cfg.model.build in (path.stem, "")  # "": architecture only
        assert cfg.model.path.endswith(f"/{path.stem}")
    OmegaConf.to_container(cfg.train, resolve=True)  # typed sections resolve


def test_defaults_come_from_the_dataclasses():
    cfg = compose()
    assert (cfg.model.name, cfg.estimator.name, cfg.agent.mode, cfg.cluster.name) == ("tiny", "grpo", "env", "local")
    assert cfg.rollout.n == 8 and cfg.fsdp.offload == "none" and cfg.engine.sync == "reload"
    assert cfg.task.train_path == str(REPO / "experiments/quickstart/data/train.jsonl")


def test_quickstart_overlay_holds_deltas():
    base, cfg = compose(), compose("experiment=quickstart")
    assert cfg.train.steps == 250 and cfg.train.lr == 2e-3 and cfg.rollout.max_lag == 1 and cfg.eval.every == 25
    assert cfg.agent.max_tokens_per_turn == 4 and cfg.train.num_threads == 1 and cfg.name == "quickstart"
    assert cfg.engine.cpu_threads == 1 and base.engine.cpu_threads == 0  # one core each for the engine and the actor
    cfg.engine.cpu_threads = 0
    assert cfg.model == base.model and cfg.engine == base.engine  # untouched groups keep their defaults


def test_smollm2_overlay_switches_model():
    cfg = compose("experiment=smollm2")
    assert cfg.model.build == "smollm2_135m" and cfg.task.name == "count"
    assert cfg.train.groups_per_step <= cfg.rollout.max_inflight_groups


def test_overrides_are_typed():
    with pytest.raises(ConfigCompositionException, match="ep_size"):
        compose("fsdp.ep_size=two")
    with pytest.raises(ConfigCompositionException, match="pth"):
        compose("model.pth=/x")  # struct: a misspelt key is an error (only `+key=` adds one on purpose)


def test_typo_in_group_file_is_rejected(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "model/typo.yaml").write_text("defaults:\n  - model_schema\nname: typo\npth: /x\n")
    with pytest.raises(ConfigCompositionException) as err:
        compose("model=typo", conf=conf)
    assert "pth" in str(err.value) + str(err.value.__cause__)


def test_cfg_job_prints_the_composed_run():
    out = subprocess.run([sys.executable, "-m", "molt", "--cfg", "job", "estimator=grpo", "fsdp.ep_size=2",
                          "model=tiny_moe"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    cfg = OmegaConf.create(out.stdout)
    assert cfg.fsdp.ep_size == 2 and cfg.model.build == "tiny_moe" and cfg.estimator.name == "grpo"
    assert "hydra" not in cfg


def test_the_installed_command_submits_from_any_directory(tmp_path):
    """The `molt` console script (not `python -m molt` in the checkout) finds the Slurm launcher, hydra_plugins/, and a
    Slurm run keeps cluster=slurm's own sweep directory (outputs/<name>/slurm/...)."""
    out = subprocess.run([str(Path(sys.executable).parent / "molt"), "cluster=slurm", "cluster.partition=p",
                          "dry_run=true"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "#SBATCH --partition=p" in out.stdout and f"{tmp_path}/outputs/molt/slurm/" in out.stdout
