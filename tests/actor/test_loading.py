"""Sharded loading (molt/actor/loading.py): meta build + per-rank slices equal the whole-model load. Multi-rank
layouts load this way in every test of tests/actor/test_parallel.py (compared with 1-rank whole loading)."""
import pytest
import torch
from safetensors.torch import load_file, save_file

from molt.actor.actor import load_model
from molt.actor.loading import SafetensorsDir, materialize, meta_model
from molt.assets import ensure_model


@pytest.fixture(scope="module", params=["tiny", "tiny_moe"])
def model_dir(request, tmp_path_factory):
    return ensure_model(tmp_path_factory.mktemp("assets") / request.param, request.param)


def test_materialized_model_equals_the_whole_load(model_dir):
    whole = load_model(model_dir, "float32", "sdpa", "cpu", trainable=False)
    model = meta_model(model_dir, torch.float32)
    assert all(p.is_meta for p in model.parameters())
    materialize(model, model_dir, "cpu")
    got, ref = model.state_dict(), whole.state_dict()
    assert got.keys() == ref.keys()
    for name, t in ref.items():
        torch.testing.assert_close(got[name], t, rtol=0, atol=0, msg=name)
    buffers = dict(whole.named_buffers())
    for name, b in model.named_buffers():  # rotary tables are computed, not read
        torch.testing.assert_close(b, buffers[name], rtol=0, atol=0)


def test_expert_slices_are_read_per_expert(model_dir):
    """A region of a fused expert tensor reads only the experts it covers, fused by transformers' mapping."""
    whole = load_model(model_dir, "float32", "sdpa", "cpu", trainable=False)
    name = next((n for n, p in whole.named_parameters() if n.endswith("gate_up_proj")), None)
    if name is None:
        pytest.skip("dense model")
    ckpt = SafetensorsDir(model_dir, meta_model(model_dir, torch.float32))
    full = whole.get_parameter(name)  # (E, 2I, H)
    region = (slice(2, 4), slice(16, 80), slice(None))
    torch.testing.assert_close(ckpt.read(name, region), full[region], rtol=0, atol=0)


def test_a_missing_tensor_is_named(model_dir, tmp_path):
    weights = load_file(str(model_dir / "model.safetensors"))
    weights.pop("model.norm.weight")
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match="model.norm.weight"):
        materialize(meta_model(tmp_path, torch.float32), tmp_path, "cpu")
