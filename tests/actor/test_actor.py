import dataclasses
import random

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from molt.actor import attention
from molt.actor.actor import Actor
from molt.actor.helpers import Frozen
from molt.actor.pack import micro_batches, pack
from molt.assets import ensure_model
from molt.algo.loss import LOSSES, Objective
from molt.config import IsCorrectionConfig, LoraConfig, LossConfig, TrainConfig
from molt.types import Segment
from tests.algo.test_loss import loss_config

LENGTHS = (5, 17, 9, 30, 4, 12, 25, 8, 20, 3)  # row_tokens=32 packs these into 5 rows


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_model(tmp_path_factory.mktemp("assets") / "tiny", "tiny")


def make_segments(lengths=LENGTHS, seed=0, logprob=-1.0):
    rng = random.Random(seed)
    segs = []
    for n in lengths:
        s, prompt = Segment(), min(n - 1, rng.randint(1, 4))
        s.append([rng.randrange(3, 500) for _ in range(prompt)])
        s.append([rng.randrange(3, 500) for _ in range(n - prompt)], generated=True,
                 logprobs=[logprob] * (n - prompt), version=0)
        segs.append(s)
    return segs


def with_logprobs(segs, logprobs, shift=0.0):
    """Copies of segs whose behaviour log-probs are `logprobs` (+ shift) on generated tokens."""
    out = []
    for s, lp in zip(segs, logprobs):
        out.append(dataclasses.replace(s, logprobs=[(x + shift) * m for x, m in zip(lp, s.loss_mask)]))
    return out


def reference_logprobs(model, segs, temperature):
    """One unpacked sequence at a time, through the model's own forward (full logits)."""
    out = []
    with torch.no_grad():
        for s in segs:
            ids = torch.tensor([s.token_ids])
            logp = torch.log_softmax(model(ids).logits[0, :-1].float() / temperature, -1)  # (n-1, V)
            out.append([0.0] + logp.gather(-1, ids[0, 1:, None])[:, 0].tolist())
    return out


def test_pack_layout():
    segs = make_segments()
    adv = [[float(i + 1)] * len(s.token_ids) for i, s in enumerate(segs)]
    b = pack(segs, adv, row_tokens=32)
    assert b.num_rows == 5 and b.input_ids.shape[1] <= 32
    for i, (r, start, n) in enumerate(b.spans):
        assert b.input_ids[r, start:start + n].tolist() == segs[i].token_ids
        assert b.position_ids[r, start:start + n].tolist() == list(range(n))
        assert (b.segment_ids[r, start:start + n] == i).all()
        mask = torch.tensor(segs[i].loss_mask, dtype=torch.float32)
        assert b.loss_mask[r, start:start + n].tolist() == mask.tolist()
        assert b.advantages[r, start:start + n].tolist() == (mask * (i + 1)).tolist()  # 0 on prompt tokens
    assert int((b.segment_ids >= 0).sum()) == sum(LENGTHS)
    mbs = micro_batches(b, 2)
    assert [m.num_rows for m in mbs] == [2, 2, 1] and sum(int(m.loss_mask.sum()) for m in mbs) == b.loss_mask.sum()


def test_segment_longer_than_row_fails():
    with pytest.raises(ValueError, match=r"train\.row_tokens=16"):
        pack(make_segments((10, 17)), [1.0, 1.0], row_tokens=16)


@pytest.mark.parametrize("attn", ["molt_varlen", "sdpa", "eager"])
def test_packed_logprobs_equal_unpacked(model_dir, attn):
    actor = Actor(model_dir, TrainConfig(row_tokens=32, micro_batch_rows=2), attn_implementation=attn)
    segs = make_segments()
    packed = actor.logprobs(segs, temperature=0.7)
    ref = reference_logprobs(actor.model, segs, temperature=0.7)
    assert pack(segs, [0.0] * len(segs), 32).num_rows < len(segs)  # several segments share rows
    diff = max(abs(x - y) for p, r in zip(packed, ref) for x, y in zip(p, r))
    assert diff <= 1e-5 and all(p[0] == 0.0 for p in packed)


@pytest.mark.parametrize("loss,lora_rank", [(name, 0) for name in sorted(LOSSES)] + [("ppo_clip", 4)])
def test_gradient_independent_of_micro_batch_split(model_dir, loss, lora_rank):
    actor = Actor(model_dir, TrainConfig(row_tokens=32, micro_batch_rows=1), objective=Objective(loss_config(loss)),
                  lora_cfg=LoraConfig(rank=lora_rank, target_modules=["q_proj", "v_proj", "down_proj"]))
    segs = make_segments()
    # behaviour a little off the actor so some ratios leave the clip band
    segs = with_logprobs(segs, actor.logprobs(segs), shift=0.0)
    segs = [dataclasses.replace(s, logprobs=[x + 0.3 * ((j % 3) - 1) * m for j, (x, m) in
                                             enumerate(zip(s.logprobs, s.loss_mask))]) for s in segs]
    adv = [[(-1.0) ** i * (1 + i / 10)] * len(s.token_ids) for i, s in enumerate(segs)]
    grads, metrics = [], []
    for rows in (1, 2, 4):
        actor.cfg = dataclasses.replace(actor.cfg, micro_batch_rows=rows)
        actor.model.zero_grad(set_to_none=True)
        metrics.append(actor.backward(segs, adv))
        grads.append({k: p.grad.clone() for k, p in actor.model.named_parameters() if p.grad is not None})
    assert 0 < metrics[0]["clip/frac"] < 1
    if lora_rank:  # LoRA: gradients for the adapters only (B's: A's are 0 while B = 0)
        adapted = {k for k, m in actor.model.named_modules() if hasattr(m, "lora_A")}
        assert {k.split(".lora_")[0] for k in grads[0]} == adapted and len(adapted) == 6  # 3 targets x 2 layers
        assert all(".lora_" in k for k in grads[0]) and any(g.abs().sum() > 0 for g in grads[0].values())
    for g in grads[1:]:
        for k in g:
            torch.testing.assert_close(g[k], grads[0][k], rtol=0, atol=1e-6)
    for k in ("loss/policy", "clip/frac", "mismatch/logprob_abs_mean", "mismatch/logprob_abs_max"):
        assert metrics[1][k] == pytest.approx(metrics[0][k], abs=1e-6) == metrics[2][k]


def test_train_steps_raise_logprob_of_rewarded_tokens(model_dir):
    actor = Actor(model_dir, TrainConfig(row_tokens=64, micro_batch_rows=2, lr=1e-3))
    segs = make_segments(seed=1)
    before = actor.logprobs(segs)
    segs = with_logprobs(segs, before)  # on-policy: behaviour = actor
    metrics = [actor.train_step(segs, [1.0] * len(segs)) for _ in range(3)]
    m = metrics[0]
    assert m["mismatch/logprob_abs_max"] < 1e-5 and m["tokens/total"] == sum(LENGTHS)
    assert m["tokens/loss"] == sum(s.num_generated for s in segs) and m["grad_norm"] > 0
    assert m["loss/policy"] == pytest.approx(-1.0, abs=1e-5)  # ratio 1, A = 1 everywhere
    assert metrics[2]["mismatch/logprob_abs_mean"] > 1e-3  # the weights moved
    gen = lambda lps: sum(x for s, lp in zip(segs, lps) for x, mk in zip(lp, s.loss_mask) if mk)  # noqa: E731
    assert gen(actor.logprobs(segs)) > gen(before) + 1.0


def test_clip_inside_a_fused_adamw_is_the_clipped_step(model_dir):
    """A fused AdamW (the GPU default) takes the clip as its grad_scale: the same step, and the same clipped
    gradients left behind, as clip_grad_norm_ followed by the same AdamW."""
    train = TrainConfig(row_tokens=64, lr=1e-2, grad_clip=1e-3)
    segs, adv = make_segments(seed=3), [1.0, -1.0] * 5
    ref, got = Actor(model_dir, train), Actor(model_dir, train)
    for a in (ref, got):
        a.optimizer = torch.optim.AdamW(a.model.parameters(), lr=train.lr, betas=tuple(train.betas), fused=True)
    ref.backward(segs, adv)
    norm = torch.nn.utils.clip_grad_norm_(ref.model.parameters(), train.grad_clip)
    ref.optimizer.step()
    assert got.train_step(segs, adv)["grad_norm"] == pytest.approx(float(norm), rel=1e-6)
    assert norm > 10 * train.grad_clip  # the clip binds
    for (name, a), b in zip(ref.model.named_parameters(), got.model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-9, msg=name)  # left clipped (unclipped: 10x)
        torch.testing.assert_close(b, a, rtol=0, atol=3e-7, msg=name)


def test_mismatch_metric_measures_behaviour_gap(model_dir):
    actor = Actor(model_dir, TrainConfig(row_tokens=64))
    segs = make_segments(seed=2)
    segs = with_logprobs(segs, actor.logprobs(segs), shift=-0.1)
    m = actor.backward(segs, [0.0] * len(segs))
    assert m["mismatch/logprob_abs_mean"] == pytest.approx(0.1, abs=1e-5)
    assert m["mismatch/logprob_abs_max"] == pytest.approx(0.1, abs=1e-5)


def test_export_weights_reproduce_logits(model_dir):
    actor = Actor(model_dir, TrainConfig(row_tokens=64, lr=1e-2))
    segs = make_segments(seed=3)
    actor.train_step(with_logprobs(segs, actor.logprobs(segs)), [1.0] * len(segs))
    weights = actor.export_weights()
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        assert set(weights) == set(f.keys())  # exactly the checkpoint's (= vLLM's) names
    assert all(w.dtype == torch.float32 and w.is_contiguous() and w.device.type == "cpu" for w in weights.values())
    fresh = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32).eval()
    fresh.load_state_dict(weights, strict=True)
    ids = torch.tensor([segs[0].token_ids])
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, actor.model(ids).logits)


def test_export_includes_head_when_tied(model_dir, tmp_path):
    config = AutoConfig.from_pretrained(model_dir)
    config.tie_word_embeddings = True
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path / "tied")
    actor = Actor(tmp_path / "tied", TrainConfig())
    weights = actor.export_weights()
    assert torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    assert weights["lm_head.weight"].data_ptr() != weights["model.embed_tokens.weight"].data_ptr()


def test_a_tied_model_checkpoints_resumes_and_exports(model_dir, tmp_path):
    """SmolLM2 and Qwen3-1.7B tie the head to the embedding: the checkpoint writes the shared tensor once (safetensors
    refuses it twice), the resumed actor's head is its embedding again, and the export has both names."""
    from molt import checkpoint

    config = AutoConfig.from_pretrained(model_dir)
    config.tie_word_embeddings = True
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path / "tied")
    cfg = TrainConfig(row_tokens=64, lr=1e-2)
    a, b = Actor(tmp_path / "tied", cfg), Actor(tmp_path / "tied", cfg)
    segs = make_segments(seed=5)
    segs = with_logprobs(segs, a.logprobs(segs))
    a.train_step(segs, [1.0] * len(segs))
    path = checkpoint.save(str(tmp_path / "ckpt"), 1, a, data_position=2, model_dir=tmp_path / "tied")
    checkpoint.load(path, b)
    assert b.model.lm_head.weight is b.model.model.embed_tokens.weight
    for (k, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=k)
    exported = AutoModelForCausalLM.from_pretrained(checkpoint.export_hf(path, tmp_path / "hf"), dtype=torch.float32)
    torch.testing.assert_close(exported.lm_head.weight, a.model.model.embed_tokens.weight, rtol=0, atol=0)


def test_checkpoint_round_trip(model_dir, tmp_path):
    from molt import checkpoint

    cfg = TrainConfig(row_tokens=64, lr=1e-2)
    a, b = Actor(model_dir, cfg), Actor(model_dir, cfg)
    segs = make_segments(seed=4)
    segs = with_logprobs(segs, a.logprobs(segs))
    a.train_step(segs, [1.0] * len(segs))
    path = checkpoint.save(str(tmp_path / "ckpt"), 1, a, data_position=3, model_dir=model_dir)
    assert checkpoint.load(path, b)["data_position"] == 3
    a.train_step(segs, [0.5] * len(segs))
    b.train_step(segs, [0.5] * len(segs))  # identical only if the AdamW moments came along
    for (k, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), k


def test_warmup_ramps_the_lr_and_resumes_on_its_step(model_dir, tmp_path):
    """train.warmup_steps=4: updates 1-4 at lr/4 .. lr, then lr. AdamW's first update moves the weights whose gradient
    is far above eps by the lr itself, so the first step's largest move is lr/4; a checkpoint keeps the count."""
    from molt import checkpoint

    cfg = TrainConfig(row_tokens=64, lr=1e-2, warmup_steps=4)
    a, b = Actor(model_dir, cfg), Actor(model_dir, cfg)
    segs = make_segments(seed=5)
    segs = with_logprobs(segs, a.logprobs(segs))
    before = [p.detach().clone() for p in a.model.parameters()]
    lrs = [a.train_step(segs, [1.0, -1.0] * 5)["lr"]]
    moved = max((p - q).abs().max().item() for p, q in zip(a.model.parameters(), before))
    assert moved == pytest.approx(cfg.lr / 4, rel=1e-3)
    lrs.append(a.train_step(segs, [1.0, -1.0] * 5)["lr"])
    checkpoint.load(checkpoint.save(str(tmp_path / "ckpt"), 2, a, data_position=0, model_dir=model_dir), b)
    lrs += [a.train_step(segs, [0.5] * 10)["lr"] for _ in range(3)]
    assert lrs == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2, 1e-2])
    assert b.train_step(segs, [0.5] * 10)["lr"] == pytest.approx(7.5e-3)  # the resumed actor's third update


def kl_actor(model_dir, train, kl_coef, is_correction=None):
    """An actor whose objective has a KL penalty, with the frozen reference (the initial policy) as its helper."""
    actor = Actor(model_dir, train, objective=Objective(LossConfig(), is_correction, kl_coef))
    actor.helpers["reference"] = Frozen(actor, model_dir, replay=False)
    return actor


def _off_policy(actor, segs, scale=0.3):
    """Behaviour log-probs a little off the actor's (deterministic per token), so ratios spread around 1."""
    segs = with_logprobs(segs, actor.logprobs(segs))
    return [dataclasses.replace(s, logprobs=[x + scale * ((j % 3) - 1) * m for j, (x, m) in
                                             enumerate(zip(s.logprobs, s.loss_mask))]) for s in segs]


@pytest.mark.parametrize("level,mode,low,high", [("seq", "mask", 0.8, 1.25), ("geo", "mask", 0.95, 1.05),
                                                 ("token", "trunc", 0.0, 1.2)])
def test_gradient_independent_of_micro_batch_split_with_is_and_kl(model_dir, level, mode, low, high):
    is_cfg = IsCorrectionConfig(level=level, mode=mode, low=low, high=high)
    actor = kl_actor(model_dir, TrainConfig(row_tokens=32, lr=1e-2), 0.1, is_cfg)
    segs = make_segments()
    actor.train_step(with_logprobs(segs, actor.logprobs(segs)), [1.0] * len(segs))  # move off the reference
    segs = _off_policy(actor, segs)
    adv = [[(-1.0) ** i * (1 + i / 10)] * len(s.token_ids) for i, s in enumerate(segs)]
    grads, metrics = [], []
    for rows in (1, 2, 4):
        actor.cfg = dataclasses.replace(actor.cfg, micro_batch_rows=rows)
        actor.model.zero_grad(set_to_none=True)
        metrics.append(actor.backward(segs, adv))
        grads.append({k: p.grad.clone() for k, p in actor.model.named_parameters()})
    assert 0 < metrics[0]["is/token_gated_frac"] < 1 and metrics[0]["kl/ref_k3"] > 1e-4
    if level != "token":
        assert 0 < metrics[0]["is/seq_gated_frac"] < 1
    for g in grads[1:]:
        for k in g:
            torch.testing.assert_close(g[k], grads[0][k], rtol=0, atol=1e-6)
    for k in ("loss/policy", "loss/kl", "is/token_gated_frac", "is/seq_gated_frac", "is/ratio_min", "is/ratio_max",
              "is/ratio_mean", "kl/behaviour_k3", "entropy/mean"):
        assert metrics[1][k] == pytest.approx(metrics[0][k], abs=1e-6) == metrics[2][k], k


def test_entropy_and_reference_kl(model_dir):
    """entropy/mean equals the full-softmax entropy at the sampling temperature; the reference is the initial
    policy (KL 0 before any step, > 0 after) and is not loaded when kl_coef = 0."""
    assert Actor(model_dir, TrainConfig()).objective.needs == ()
    actor = kl_actor(model_dir, TrainConfig(row_tokens=64, lr=1e-2), 0.5)
    segs = make_segments(seed=5)
    segs = with_logprobs(segs, actor.logprobs(segs, temperature=0.7))
    m = actor.train_step(segs, [1.0] * len(segs), temperature=0.7)
    with torch.no_grad():
        expected = []
        for s in segs:
            logits = actor.helpers["reference"].model(torch.tensor([s.token_ids])).logits[0, :-1].float() / 0.7  # (n-1, V)
            h = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
            expected += [x for x, mk in zip(h.tolist(), s.loss_mask[1:]) if mk]
    assert m["entropy/mean"] == pytest.approx(sum(expected) / len(expected), abs=1e-5)
    assert m["kl/ref_k3"] == pytest.approx(0.0, abs=1e-7)
    assert actor.train_step(segs, [1.0] * len(segs), temperature=0.7)["kl/ref_k3"] > 1e-4
    assert all(not p.requires_grad for p in actor.helpers["reference"].model.parameters())


def test_lora_reference_is_the_base_model_without_a_second_copy(model_dir):
    """With LoRA, train.kl_coef > 0 scores the reference with the policy's own model, adapters bypassed: the base
    model's log-probs (a plain actor's), a KL of 0 before any step and > 0 after; nothing else is loaded."""
    from molt.actor.group import run_actor
    from tests.test_config import compose

    cfg = compose("lora.rank=4", "train.kl_coef=0.5", "train.row_tokens=64", "train.lr=1e-2")
    actor = run_actor(cfg, model_dir)
    ref = actor.helpers["reference"]
    assert ref.model is actor.model
    segs = make_segments(seed=5)
    segs = with_logprobs(segs, actor.logprobs(segs))
    assert actor.train_step(segs, [1.0] * len(segs))["kl/ref_k3"] == pytest.approx(0.0, abs=1e-7)
    assert actor.train_step(segs, [1.0] * len(segs))["kl/ref_k3"] > 1e-4
    base = Actor(model_dir, TrainConfig(row_tokens=64)).logprobs(segs)
    scored = actor._per_token(lambda mb: ref.score(mb, 1.0), segs)
    diff = lambda a, b: max(abs(x - y) for p, q in zip(a, b) for x, y in zip(p, q))  # noqa: E731
    assert diff(scored, base) <= 1e-6 and diff(actor.logprobs(segs), base) > 1e-3


def grouped_segments(prompts=(6, 3, 11), n=4, seed=0, part=0):
    """len(prompts) groups of n samples each: one prompt per group, replies of 1-6 tokens, behaviour log-probs
    around -1. part > 0: each sample's prompt has an id of its own `part` ids before the prompt's end (an agent's
    scratch path)."""
    rng, segs = random.Random(seed), []
    for q in prompts:
        prompt = [rng.randrange(3, 500) for _ in range(q)]
        for _ in range(n):
            s, k = Segment(), rng.randint(1, 6)
            if part:
                prompt = prompt[:q - part] + [rng.randrange(3, 500)] + prompt[q - part + 1:]
            s.append(prompt)
            s.append([rng.randrange(3, 500) for _ in range(k)], generated=True,
                     logprobs=[-1.0 + rng.uniform(-0.3, 0.3) for _ in range(k)], version=0)
            segs.append(s)
    return segs


def test_shared_prompts_pack_once_and_keep_every_token():
    segs = grouped_segments() + make_segments((5, 9))  # two lone segments with prompts of their own
    plain, shared = pack(segs, [1.0] * len(segs), 64), pack(segs, [1.0] * len(segs), 64, share=True)
    real = lambda b: int((b.segment_ids >= 0).sum())  # noqa: E731
    assert real(plain) == sum(len(s.token_ids) for s in segs)
    assert real(shared) == real(plain) - 3 * (5 + 2 + 10)  # the groups' prompts but their last token, 3 of 4 times
    for i, (r, start, n) in enumerate(shared.spans):  # each member's own tokens: its prompt's end and its reply
        assert shared.input_ids[r, start:start + n].tolist() == segs[i].token_ids[-n:]
        end = len(segs[i].token_ids)
        assert shared.position_ids[r, start:start + n].tolist() == list(range(end - n, end))
        assert shared.loss_mask[r, start:start + n].tolist() == segs[i].loss_mask[-n:]
    assert shared.loss_mask.sum() == plain.loss_mask.sum() and shared.num_rows < plain.num_rows
    tight = pack(segs, [1.0] * len(segs), 20, share=True)  # a group that does not fit a row goes into several
    assert real(tight) > real(shared) and tight.loss_mask.sum() == plain.loss_mask.sum()
    parted = grouped_segments(part=2)  # the prompts part 2 ids before their end: 4 and 9 ids shared; of 3, 1 is not
    plain, shared = pack(parted, [1.0] * 12, 64), pack(parted, [1.0] * 12, 64, share=True)  # half a prompt or more
    assert real(shared) == real(plain) - 3 * (4 + 9) and shared.loss_mask.sum() == plain.loss_mask.sum()


@pytest.mark.parametrize("loss,mask_elements,part", [("ppo_clip", 1 << 24, 0), ("gspo", 1 << 24, 0),
                                                     ("ppo_clip", 1, 0), ("ppo_clip", 1 << 24, 2)])
def test_shared_prompts_give_the_unshared_step(model_dir, loss, mask_elements, part, monkeypatch):
    """train.share_prefix: the same loss, metrics, kept log-probs, gradients and updated weights as every sample's
    prompt in full (fp32 sums in another order), from fewer tokens; a group's samples in one attention call, or
    (mask_elements=1) each alone; part=2: prompts that part before their end share up to there."""
    monkeypatch.setattr(attention, "MASK_ELEMENTS", mask_elements)
    segs = grouped_segments(part=part)
    adv = [(-1.0) ** i * (1 + i / 10) for i in range(len(segs))]
    out = []
    for share in (False, True):
        actor = Actor(model_dir, TrainConfig(row_tokens=32, micro_batch_rows=2, share_prefix=share, lr=1e-2),
                      objective=Objective(loss_config(loss)))
        metrics = actor.train_step(segs, adv, temperature=0.7, keep_logprobs=True)
        out.append((metrics, actor.kept_logprobs(), {k: p.grad.clone() for k, p in actor.model.named_parameters()},
                    {k: p.detach().clone() for k, p in actor.model.named_parameters()}))
    (m0, kept0, g0, w0), (m1, kept1, g1, w1) = out
    assert m1["tokens/total"] < 0.8 * m0["tokens/total"] and m1["tokens/loss"] == m0["tokens/loss"]
    for k in ("loss/policy", "clip/frac", "mismatch/logprob_abs_mean", "mismatch/logprob_abs_max", "entropy/mean",
              "grad_norm"):
        assert m1[k] == pytest.approx(m0[k], abs=1e-6), k
    assert max(abs(x - y) for a, b in zip(kept0, kept1) for x, y in zip(a, b)) <= 1e-6
    assert sum(x != 0 for a in kept1 for x in a) == m0["tokens/loss"]
    for k in g0:
        scale = g0[k].abs().max().item()
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-4, atol=1e-6 * max(scale, 1.0), msg=k)
        torch.testing.assert_close(w1[k], w0[k], rtol=0, atol=0.01 * 1e-2, msg=k)  # 1% of a step (AdamW: lr g / |g|)
