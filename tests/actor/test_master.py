"""fp32 master weights in the optimizer (molt/actor/master.py), the single-GPU actor's path, checked on CPU: the
update is torch's AdamW on the masters, micro-batches accumulate in fp32, and a checkpoint keeps the masters."""
import gc
import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM

from molt.actor.actor import Actor
from molt.actor.master import MasterAdamW
from molt.assets import ensure_model
from molt.config import TrainConfig
from tests.actor.test_actor import make_segments, with_logprobs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_model(tmp_path_factory.mktemp("assets") / "tiny", "tiny")


@pytest.mark.parametrize("compile", [False, True])
def test_the_update_is_torchs_adamw_on_the_fp32_masters(compile):
    """Against torch.optim.AdamW on fp32 parameters fed the same (bf16) gradients, clip scale and weight decay
    included: the masters follow it to float rounding, and the bf16 parameters are the masters rounded (eager, and
    compiled into one kernel per tensor as on the GPU)."""
    torch.manual_seed(0)
    w = [torch.randn(64, 32), torch.randn(7)]
    ref = [torch.nn.Parameter(t.clone()) for t in w]
    got = [torch.nn.Parameter(t.clone()) for t in w]
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    torch_opt, opt = torch.optim.AdamW(ref, **kw), MasterAdamW(got, compile=compile, **kw)
    assert all(p.dtype == torch.bfloat16 for p in got)
    for step in range(5):
        grads = [torch.randn_like(t).bfloat16() for t in w]
        scale = torch.tensor(1.0 + step)  # a clip factor, as Actor.clip_grads sets it
        for p, q, g in zip(ref, got, grads):
            p.grad, q.grad = g.float() / scale, g
        opt.grad_scale = scale
        torch_opt.step()
        opt.step()
    for p, q in zip(ref, got):
        master = opt.state[q]["master"]
        torch.testing.assert_close(master, p.detach(), rtol=1e-6, atol=1e-7)
        assert master.dtype == torch.float32 and torch.equal(q.detach(), master.bfloat16())


def test_micro_batches_accumulate_in_fp32():
    """With stash on, each backward's bf16 gradient lands in an fp32 buffer: the sum is exact in fp32, where
    accumulating in the bf16 .grad rounds at every add."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 256, bias=False)
    opt = MasterAdamW(layer.parameters(), lr=1e-3)
    xs = [torch.randn(8, 256).bfloat16() for _ in range(4)]
    single = []
    for x in xs:
        opt.zero_grad()
        layer(x).square().sum().backward()
        single.append(layer.weight.grad.float())
    opt.zero_grad()
    opt.stash = True
    for x in xs:
        layer(x).square().sum().backward()
    (got,) = opt.grads()
    assert layer.weight.grad is None and got.dtype == torch.float32
    assert torch.equal(got, single[0] + single[1] + single[2] + single[3])
    opt.stash = False
    opt.zero_grad()
    for x in xs:
        layer(x).square().sum().backward()
    assert not torch.equal(layer.weight.grad.float(), got)  # what bf16 accumulation would have given
    gone = weakref.ref(opt), weakref.ref(layer.weight)
    del opt, layer
    gc.collect()
    assert gone[0]() is None and gone[1]() is None  # the gradient hooks do not keep the optimizer alive


def test_a_master_actor_trains_checkpoints_and_resumes_exactly(model_dir, tmp_path):
    """The actor in bf16 with fp32 masters (as on one GPU), two micro-batches: a checkpoint restores masters and
    moments at fp32, so the resumed actor's next step equals the uninterrupted one's; its weights are the masters
    (the Hugging Face export has them, and an fp32 actor, e.g. FSDP2 at several ranks, resumes them)."""
    from molt import checkpoint

    cfg = TrainConfig(row_tokens=64, lr=1e-2, micro_batch_rows=1)
    a, b = Actor(model_dir, cfg, master=True), Actor(model_dir, cfg, master=True)
    assert a.model.model.embed_tokens.weight.dtype == torch.bfloat16
    segs = make_segments(seed=4)
    segs = with_logprobs(segs, a.logprobs(segs))
    before = a.optimizer.state[a.model.model.norm.weight]["master"].clone()
    a.train_step(segs, [1.0] * len(segs))
    master = a.optimizer.state[a.model.model.norm.weight]["master"]
    assert not torch.equal(master, before) and torch.equal(a.model.model.norm.weight.detach(), master.bfloat16())
    path = checkpoint.save(str(tmp_path / "ckpt"), 1, a, data_position=3, model_dir=model_dir)
    masters = {n: a.optimizer.state[p]["master"].clone() for n, p in a.model.named_parameters()}
    checkpoint.load(path, b)
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        for k in ("master", "exp_avg", "exp_avg_sq"):
            x, y = a.optimizer.state[p][k], b.optimizer.state[q][k]
            assert y.dtype == torch.float32 and torch.equal(x, y), k
    a.train_step(segs, [0.5] * len(segs))
    b.train_step(segs, [0.5] * len(segs))
    for (k, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), k
    # the masters are the checkpoint's weights: the export, and an fp32 actor resuming it, have them
    state = AutoModelForCausalLM.from_pretrained(checkpoint.export_hf(path, tmp_path / "hf")).state_dict()
    fp32 = Actor(model_dir, cfg)
    checkpoint.load(path, fp32)
    fp32_params = dict(fp32.model.named_parameters())
    for p, s in masters.items():
        assert state[p].dtype == torch.float32 and torch.equal(state[p], s), p
        assert torch.equal(fp32_params[p].detach(), s), p
