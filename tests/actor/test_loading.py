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


def test_a_tied_head_stays_tied(tmp_path):
    """tie_word_embeddings (Qwen3-1.7B, SmolLM2): the head IS the embedding after a meta build, so the checkpoint
    (which has no lm_head.weight) loads and training updates one tensor."""
    import json

    from transformers import AutoModelForCausalLM, Qwen3Config

    from molt.actor.parallel import build_mesh, parallelize
    from molt.assets import tiny_config
    from molt.config import FsdpConfig

    spec = {k: v for k, v in tiny_config().items() if k not in ("model_type", "architectures")}
    AutoModelForCausalLM.from_config(Qwen3Config(**spec | dict(tie_word_embeddings=True))).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"]
    whole = load_model(tmp_path, "float32", "sdpa", "cpu", trainable=False)
    model = meta_model(tmp_path, torch.float32)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    materialize(model, tmp_path, "cpu")
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    torch.testing.assert_close(model.lm_head.weight, whole.lm_head.weight, rtol=0, atol=0)
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:  # the GPU runs' path: laid out (FSDP2) on the meta device, then each rank's shards read
        fsdp = FsdpConfig()
        model = parallelize(meta_model(tmp_path, torch.float32), build_mesh(fsdp, "cpu"), fsdp)
        materialize(model, tmp_path, "cpu")
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
        torch.testing.assert_close(model.lm_head.weight.full_tensor(), whole.lm_head.weight, rtol=0, atol=0)
    finally:
        torch.distributed.destroy_process_group()
