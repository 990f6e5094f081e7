"""Context parallelism: the sliced, next-token-aligned forward on cp ranks reproduces the 1-rank log-probs, loss and
gradients (real gloo process groups in spawned processes, tiny dense and MoE Qwen3 models, packed rows)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from molt.actor import context
from molt.actor.actor import load_model, token_logprobs
from molt.actor.pack import NO_TARGET, align_next, cp_slice, cp_unslice, cp_width, pack, unalign
from molt.algo.loss import Objective
from molt.assets import ensure_model
from molt.config import FsdpConfig
from molt.net import free_port
from tests.actor.test_actor import make_segments
from tests.ranks import spawn

LENGTHS = (13, 7, 9, 5, 10, 3, 6, 4)  # 3 rows of 23, 22, 12 tokens: cp_slice pads them to 24 columns
TEMPERATURE = 0.7
KINDS = ("tiny", "tiny_moe")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    return {k: str(ensure_model(root / k, k)) for k in KINDS}


def make_batch():
    """Packed rows with behaviour log-probs near a random 512-token model's and mixed-sign advantages."""
    segs = make_segments(LENGTHS, seed=1, logprob=-6.0)
    g = torch.Generator().manual_seed(0)
    adv = [torch.randn(len(s.token_ids), generator=g).tolist() for s in segs]
    return pack(segs, adv, row_tokens=24), sum(s.num_generated > 0 for s in segs)


def run_loss(model, batch, num_loss_tokens, n_seq):
    """Log-probs of every predicted token (no grad), then the actor's loss with its backward.
    Gotcha: in this order, as FSDP2 leaves its root unsharded after a forward (parameters without .grad)."""
    with torch.no_grad():
        every = token_logprobs(model, batch, TEMPERATURE)  # (R, T)
    logp, ent = token_logprobs(model, batch, TEMPERATURE, loss_only=True, entropy=True)  # (R, T) x 2
    loss, _ = Objective()(logp, ent, batch, num_loss_tokens, n_seq)
    loss.backward()
    return loss.detach(), every


def reference(model_dir):
    """1 rank, token alignment, transformers' own sdpa packing: the numerical reference."""
    torch.manual_seed(0)
    model = load_model(model_dir, "float32", "sdpa", "cpu")
    batch, n_seq = make_batch()
    loss, every = run_loss(model, batch, int(batch.loss_mask.sum()), n_seq)
    return loss, every, {k: p.grad.clone() for k, p in model.named_parameters()}


def _cp_result(model, mesh, batch, n_seq, rank, via_parallelize):
    """(loss, every log-prob in token alignment, full gradients) of this cp rank's slice, summed over the cp group."""
    group = mesh["cp"].get_group()
    local, _ = cp_slice(align_next(batch), mesh["cp"].size(), rank)
    loss, every = run_loss(model, local, int(batch.loss_mask.sum()), n_seq)
    dist.all_reduce(loss, group=group)  # each token counted once, on one cp rank: the loss is the sum
    every = unalign(context.gather_columns(every, group, batch.input_ids.shape[1]))  # (R, T)
    if via_parallelize:
        from molt.actor.parallel import full_tensors

        return loss, every, full_tensors(model, grads=True)
    grads = {k: p.grad for k, p in model.named_parameters()}
    for g in grads.values():
        dist.all_reduce(g, group=group)  # the cp ranks' partial gradients of one loss add up
    return loss, every, grads


def _cp_rank(rank, world, port, model_dirs, modes, out):
    """One cp rank: each model with context.enable on a 1-D cp mesh (grads all-reduced by hand) and/or through
    parallel.parallelize (FSDP2 over the cp ranks, which sums the gradients)."""
    from molt.actor.parallel import build_mesh, parallelize

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    try:
        results, batch, n_seq = {}, *make_batch()
        for via_parallelize in modes:
            for kind, path in model_dirs.items():
                model = load_model(path, "float32", "sdpa", "cpu")
                if via_parallelize:
                    mesh = build_mesh(FsdpConfig(cp_size=world), "cpu")
                    parallelize(model, mesh, FsdpConfig(cp_size=world))
                else:
                    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
                    context.enable(model, mesh["cp"])
                results[kind, via_parallelize] = _cp_result(model, mesh, batch, n_seq, rank, via_parallelize)
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def references(model_dirs):
    return {kind: reference(model_dirs[kind]) for kind in KINDS}


@pytest.mark.parametrize("world,modes", [(2, (False, True)), (4, (False,))])  # parallelize at cp=2 only (time)
def test_cp_matches_one_rank(model_dirs, references, tmp_path, world, modes):
    out = tmp_path / "cp.pt"
    spawn(_cp_rank, args=(world, free_port(), model_dirs, modes, str(out)), nprocs=world)
    for (kind, via_parallelize), (loss, every, grads) in torch.load(out).items():
        ref_loss, ref_every, ref_grads = references[kind]
        what = f"{kind}, cp={world}, {'parallelize' if via_parallelize else 'context.enable'}"
        assert ref_every.abs().sum() > 0 and ref_loss.abs() > 0
        torch.testing.assert_close(every, ref_every, atol=1e-5, rtol=1e-5, msg=f"{what}: log-probs")
        torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-5, msg=f"{what}: loss")
        assert grads.keys() == ref_grads.keys()
        for name, g in ref_grads.items():
            assert g.abs().sum() > 0, name
            torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-4, msg=f"{what}: grad of {name}")


def test_align_next_moves_target_side_columns():
    batch, _ = make_batch()
    a = align_next(batch)
    seg, ids = batch.segment_ids, batch.input_ids
    for r in range(batch.num_rows):
        for t in range(ids.shape[1]):
            follows = t + 1 < ids.shape[1] and seg[r, t] >= 0 and seg[r, t + 1] == seg[r, t]
            assert a.targets[r, t] == (ids[r, t + 1] if follows else NO_TARGET)
    for k in ("loss_mask", "behaviour_logp", "advantages"):
        torch.testing.assert_close(unalign(getattr(a, k)), getattr(batch, k))  # segment starts carry no loss
    assert torch.equal(a.input_ids, ids) and torch.equal(a.position_ids, batch.position_ids)


def test_aligned_logprobs_and_loss_equal_token_alignment(model_dirs):
    """Without CP, the next-token alignment gives the same log-probs (mapped back) and the same loss."""
    model = load_model(model_dirs["tiny"], "float32", "sdpa", "cpu", trainable=False)
    batch, n_seq = make_batch()
    n = int(batch.loss_mask.sum())
    out = []
    with torch.no_grad():
        for b in (batch, align_next(batch)):
            logp, ent = token_logprobs(model, b, TEMPERATURE, loss_only=True, entropy=True)  # (R, T) x 2
            out.append((Objective()(logp, ent, b, n, n_seq)[0], logp,
                        token_logprobs(model, b, TEMPERATURE)))
    (loss, logp, every), (a_loss, a_logp, a_every) = out
    assert every.abs().sum() > 0 and (logp != 0).sum() == batch.loss_mask.sum()
    torch.testing.assert_close(unalign(a_logp), logp)
    torch.testing.assert_close(unalign(a_every), every)
    torch.testing.assert_close(a_loss, loss)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_cp_slice_round_trip(cp):
    batch = align_next(make_batch()[0])
    R, T = batch.input_ids.shape
    batch.routed_experts = torch.randint(0, 8, (R, T, 2, 2))  # (R, T, layers, top_k): sliced like any column
    slices = [cp_slice(batch, cp, r) for r in range(cp)]
    width = cp_width(T, cp)
    for r, (s, cols) in enumerate(slices):
        c = width // (2 * cp)  # chunk r and its mirror 2cp-1-r: equal causal work on every rank
        assert cols.tolist() == list(range(r * c, (r + 1) * c)) + list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))
        assert s.input_ids.shape == (R, width // cp)
    for name in ("input_ids", "position_ids", "segment_ids", "loss_mask", "behaviour_logp", "advantages", "targets",
                 "routed_experts"):
        parts = [getattr(s, name) for s, _ in slices]
        assert torch.equal(cp_unslice(parts, T), getattr(batch, name)), name
    padding = cp_unslice([s.segment_ids for s, _ in slices], width)[:, T:]  # (R, width - T)
    assert (padding == -1).all() and (cp_unslice([s.targets for s, _ in slices], width)[:, T:] == NO_TARGET).all()


def test_cp_slice_refuses_unaligned_rows():
    batch = make_batch()[0]
    with pytest.raises(AssertionError, match="align_next"):
        cp_slice(batch, 2, 0)
