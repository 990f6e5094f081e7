"""The multi-GPU layout benchmark on CPU (gloo, tiny shapes): the same code the GPU machines run, so that it stays
runnable, reproduces the 1-rank gradients and delivers the broadcast weights intact."""
import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "experiments" / "benchmarks" / "actor_layouts.py"


def torchrun(n: int, *args: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), str(SCRIPT), "--smoke", "--cpu",
           "--model", "moe", "--shards", "2", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_layouts_reproduce_the_reference_and_broadcast_intact(tmp_path):
    ref = tmp_path / "ref.pt"
    common = ["--reference", str(ref), "--workdir", str(tmp_path)]
    assert "reference written" in torchrun(1, *common)
    out = torchrun(2, *common, "--layouts", "dp2,ep2,cp2", "--broadcast", "--bucket-mb", "1")
    rows = re.findall(r"\| (dp\d x ep\d x cp\d) .*\| ([\d.e+-]+) \| ([\d.e+-]+) \(", out)
    assert [r[0] for r in rows] == ["dp2 x ep1 x cp1", "dp1 x ep2 x cp1", "dp1 x ep1 x cp2"], out
    for layout, loss_err, grad_err in rows:
        assert float(loss_err) < 1e-4 and float(grad_err) < 1e-3, (layout, loss_err, grad_err)
    assert "received intact" in out and "packed buckets of 1 MiB" in out
