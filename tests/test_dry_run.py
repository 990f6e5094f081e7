"""`molt cluster=slurm ... dry_run=true` on a machine without Slurm: the guard rails pass, then the sbatch script
that submission would send is printed, made through submitit's private `_make_sbatch_string` (molt/cluster.py
sbatch_script). A submitit upgrade that removes or changes what the script is made of fails here; the Slurm tests
(tests/cluster) check that the printed script is the one submitted."""
from __future__ import annotations

import shutil
import sys
from types import SimpleNamespace

from submitit import SlurmExecutor

from molt.cli import main

SLURM_COMMANDS = ("srun", "sbatch", "scontrol", "squeue", "sacct")


def test_slurm_dry_run_needs_no_slurm(tmp_path, monkeypatch, capsys):
    bare = tmp_path / "bin"  # the only PATH entry: no Slurm command, installed or not
    bare.mkdir()
    monkeypatch.setenv("PATH", str(bare))
    assert not [c for c in SLURM_COMMANDS if shutil.which(c)]
    python, sweep = "/opt/venv/bin/python", tmp_path / "sweep"
    monkeypatch.setattr(sys, "argv", [
        "molt", "-m", "cluster=slurm_local", "experiment=quickstart", "estimator=grpo,rloo", "cluster.mem_gb=16",
        "+cluster.extra_sbatch.mail-type=END", "cluster.extra_srun=['--mpi=none']", f"cluster.python={python}",
        "cluster.setup=['module load cuda']", "dry_run=true", f"hydra.sweep.dir={sweep}",
        "hydra/hydra_logging=none"])  # in process: leave pytest's logging alone
    main()
    out = capsys.readouterr().out
    assert "molt dry run: 2 Slurm job(s) pass the guard rails" in out, out
    for est in ("grpo", "rloo"):  # each job's plan, composed as its node will
        assert f"estimator     {est}\n" in out and "layout        dp 1 x ep 1 x cp 1 = world size 1" in out, out
    folder = sweep / ".submitit" / "%j"
    for line in ["#SBATCH --partition=debug", "#SBATCH --array=0-1%2", "#SBATCH --cpus-per-task=2", "#SBATCH --time=30",
                 "#SBATCH --mem=16GB", "#SBATCH --mail-type=END", "#SBATCH --job-name=quickstart",
                 "#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1", "#SBATCH --signal=USR2@90",
                 f"#SBATCH --output={folder.parent}/%A_%a/%A_%a_0_log.out", "# setup\nmodule load cuda\n"]:
        assert line in out, (line, out)
    # the job command is submitit's own (SlurmExecutor._submitit_command_str, read on the class: no srun here)
    command = SlurmExecutor._submitit_command_str.fget(SimpleNamespace(python=python, folder=folder))
    assert f"\nsrun --unbuffered --output {folder.parent}/%A_%a/%A_%a_%t_log.out" in out, out
    assert f" --mpi=none {command}\n" in out, (command, out)
    assert not (sweep / ".submitit").exists()  # nothing written for a job
