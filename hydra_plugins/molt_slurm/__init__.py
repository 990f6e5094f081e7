"""`hydra/launcher: molt_slurm`: Hydra's submitit Slurm launcher with Molt's submission (molt/cluster.py).

Hydra only instantiates launchers defined under the `hydra_plugins` namespace package, hence this shim;
everything it does lives in molt.cluster.
"""
from dataclasses import dataclass

from hydra.core.config_store import ConfigStore
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher


class MoltSlurmLauncher(SlurmLauncher):
    """Guard rails on the login node, dry_run prints the sbatch script, resources come from cfg.cluster."""

    def launch(self, job_overrides, initial_job_idx):
        from molt.cluster import launch

        return launch(self, job_overrides, initial_job_idx)


@dataclass
class MoltSlurmConf:
    _target_: str = "hydra_plugins.molt_slurm.MoltSlurmLauncher"
    submitit_folder: str = "${hydra.sweep.dir}/.submitit/%j"


ConfigStore.instance().store(group="hydra/launcher", name="molt_slurm", node=MoltSlurmConf, provider="molt")
