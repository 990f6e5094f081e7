"""The single-process policy actor: a Hugging Face causal LM, AdamW, packed rows, one global loss normalisation.

    actor = Actor("assets/tiny", TrainConfig())
    metrics = actor.train_step(segments, advantages)   # pack -> micro-batches -> backward -> clip -> step
    engine_weights = actor.export_weights()            # HF names, fp32, lm_head.weight always present

The model runs in eval mode (no dropout) so its forward is the engine's forward; gradients flow as usual.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM
from transformers.core_model_loading import revert_weight_conversion

from molt.actor import context, parallel, replay, speed
from molt.actor.pack import NO_TARGET, align_next, cp_slice, micro_batches, pack, to_device, unalign
from molt.algo.loss import actor_loss, combine
from molt.types import Batch, Segment

if TYPE_CHECKING:  # molt.config imports Hydra, which the GPU image lacks
    from torch.distributed.device_mesh import DeviceMesh

    from molt.config import FsdpConfig, IsCorrectionConfig, TrainConfig

ATTENTION = ("sdpa", "eager", "flex_attention")  # all honour packed rows through position_ids (see pack.py, speed.py)
HEAD_CHUNK = 1024  # tokens per vocabulary projection: bounds the live (tokens, vocab) logits


def _chosen_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                     entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits = head(hidden).float() / temperature  # (N, V); engines report log-probs after temperature
    lse = logits.logsumexp(-1)  # (N,)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse  # (N,)
    if not entropy:
        return logp, None
    with torch.no_grad():  # logged only: H = logsumexp(z) - sum_v softmax(z)_v z_v
        return logp, lse - (logits.softmax(-1) * logits).sum(-1)  # (N,), (N,)


def head_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                  chunk: int = HEAD_CHUNK, entropy: bool = False,
                  fn=_chosen_logprobs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(targets | hidden) and (if asked) the entropy of each token's distribution, chunk by chunk;
    under grad each chunk's logits are recomputed in backward (checkpoint) instead of being kept, so at most
    `chunk` x vocab logits live at once. `fn` is _chosen_logprobs or its compiled twin (speed.compile_model)."""
    grad = torch.is_grad_enabled()
    parts = [checkpoint(fn, head, h, t, temperature, entropy, use_reentrant=False) if grad
             else fn(head, h, t, temperature, entropy)
             for h, t in zip(hidden.split(chunk), targets.split(chunk))]
    logp = torch.cat([p[0] for p in parts])  # (N,)
    return logp, torch.cat([p[1] for p in parts]) if entropy else None


def token_logprobs(model, batch: Batch, temperature: float = 1.0, loss_only: bool = False,
                   entropy: bool = False):
    """Per-token log-probs (R, T) in the batch's alignment; 0 where nothing is predicted (segment starts, padding)
    and, with loss_only, off the loss mask. With entropy=True returns (logp, entropy), both (R, T), the entropy of
    the distribution each log-prob's token was drawn from.
      token alignment (pack): at t, log p(input_ids[t] | prefix), from hidden t-1.
      next-token alignment (batch.targets set, pack.align_next): at t, log p(targets[t] | prefix), from hidden t;
      the only one context parallelism allows (hidden t-1 may live on another rank). pack.unalign maps back.

    Gotcha: transformers derives the block-diagonal causal mask from the position resets only when there is no
    2-D attention mask AND no KV cache; use_cache=False is required (the config default builds a cache, and then
    packed segments attend to each other). A context-parallel model gets its own mask (context.forward_kwargs).
    """
    assert temperature > 0, "log-probs need a sampling temperature > 0 (rollout.temperature)"
    if batch.targets is None:  # token (r, c) is predicted from hidden (r, c - 1)
        want = (batch.position_ids > 0) & (batch.segment_ids >= 0)  # (R, T)
        targets, back = batch.input_ids, 1
    else:  # hidden (r, c) predicts targets (r, c)
        want, targets, back = batch.targets != NO_TARGET, batch.targets, 0
    # nonzero waits for the device: do it before the forward is queued, not after (the GPU would idle meanwhile)
    rows, cols = (batch.loss_mask.bool() if loss_only else want).nonzero(as_tuple=True)  # (N,), (N,)
    out = model.get_decoder()(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False,
                              **context.forward_kwargs(model, batch))
    hidden = out.last_hidden_state  # (R, T, H)
    lp, ent = head_logprobs(model.get_output_embeddings(), hidden[rows, cols - back], targets[rows, cols],
                            temperature, entropy=entropy, fn=getattr(model, "molt_head_fn", _chosen_logprobs))
    scatter = lambda x: torch.zeros(want.shape, dtype=x.dtype, device=x.device).index_put((rows, cols), x)  # noqa: E731
    return (scatter(lp), scatter(ent)) if entropy else scatter(lp)  # (R, T)


def load_model(model_dir: str | Path, dtype: str, attn_implementation: str, device, trainable: bool = True,
               activation_checkpointing: bool = False, compile: bool = False):
    """A Hugging Face causal LM in eval mode (no dropout: its forward is the engine's); frozen unless trainable.
    MoE experts run transformers' default "grouped_mm" implementation (speed.py says why)."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=_dtype(dtype),
                                                 attn_implementation=attn_implementation).to(device)
    if trainable and activation_checkpointing:
        speed.checkpoint_layers(model)  # before any fully_shard: FSDP2 then wraps the checkpointed layers
    if compile:
        speed.compile_model(model, _chosen_logprobs)  # after checkpointing: the recompute is compiled too
    return model.eval().requires_grad_(trainable)


@torch.no_grad()
def per_token(fn, segments: list[Segment], train: TrainConfig, device) -> list[list[float]]:
    """fn(micro-batch) -> (r, t) tensor, run over the packed segments and cut back into one list per segment."""
    batch = pack(segments, [0.0] * len(segments), train.row_tokens)
    out = torch.zeros(batch.input_ids.shape)  # (R, T)
    row = 0
    for mb in micro_batches(batch, train.micro_batch_rows):
        x = fn(to_device(mb, device)).float().cpu()  # (r, t)
        out[row:row + mb.num_rows, :x.shape[1]] = x
        row += mb.num_rows
    return [out[r, s:s + n].tolist() for r, s, n in batch.spans]


def segment_logprobs(model, segments: list[Segment], temperature: float, train: TrainConfig,
                     device) -> list[list[float]]:
    """Per-token log-probs of each segment under `model` (0.0 at position 0): the actor's, a teacher's."""
    return per_token(lambda mb: token_logprobs(model, mb, temperature), segments, train, device)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"model.dtype={name!r} is not a torch dtype (use float32 or bfloat16)")
    return dtype


class Actor:
    """One rank of the policy. Without a mesh: the plain single-process actor (the numerical reference). With a
    mesh (one per rank, see molt/actor/group.py): the model is parallelized (molt/actor/parallel.py), every rank
    receives the whole batch and trains its own data shard, and every method is a collective."""

    def __init__(self, model_dir: str | Path, train: TrainConfig, dtype: str = "float32",
                 attn_implementation: str = "sdpa", device: str = "cpu", is_correction: IsCorrectionConfig = None,
                 fsdp: FsdpConfig | None = None, mesh: DeviceMesh | None = None):
        if attn_implementation not in ATTENTION:
            raise ValueError(f"attn_implementation={attn_implementation!r}: use one of {ATTENTION}")
        if train.num_threads > 0:
            torch.set_num_threads(train.num_threads)
        self.cfg, self.device, self.is_correction, self.mesh = train, torch.device(device), is_correction, mesh
        load_to = self.device if mesh is None else "cpu"  # fully_shard moves the shards to the mesh's device
        self.model = load_model(model_dir, dtype, attn_implementation, load_to,
                                activation_checkpointing=train.activation_checkpointing, compile=train.compile)
        # the KL penalty's reference: a frozen copy of the initial policy, loaded only when it is used
        self.reference = load_model(model_dir, dtype, attn_implementation, load_to, trainable=False,
                                    compile=train.compile) if train.kl_coef > 0 else None
        if train.routing_replay:  # MoE routers take the engine's recorded experts (molt/actor/replay.py)
            for model in filter(None, (self.model, self.reference)):
                replay.install(model)
        if mesh is not None:
            for model in filter(None, (self.model, self.reference)):
                parallel.parallelize(model, mesh, fsdp, mixed_precision=self.device.type == "cuda" and
                                     dtype == "float32")
        # fused: one kernel for the whole update on the GPU (foreach AdamW took a quarter of an MoE step there)
        on_gpu = self.device.type == "cuda" and (fsdp is None or fsdp.offload != "optimizer")
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=train.lr, betas=tuple(train.betas),
                                           weight_decay=train.weight_decay, fused=on_gpu or None)

    def backward(self, segments: list[Segment], advantages: list, temperature: float = 1.0,
                 num_loss_tokens: int | None = None, num_sequences: int | None = None) -> dict[str, float]:
        """Accumulate the batch's policy gradient into .grad (no step). num_loss_tokens and num_sequences
        (segments with loss tokens) default to this batch's counts; data-parallel callers pass all-ranks totals."""
        batch = pack(segments, advantages, self.cfg.row_tokens)
        local_loss_tokens = int(batch.loss_mask.sum())
        n = num_loss_tokens or local_loss_tokens
        if n == 0:
            raise ValueError("the batch has no generated (loss-mask 1) tokens to train on")
        n_seq = num_sequences or sum(s.num_generated > 0 for s in segments)
        totals: dict[str, torch.Tensor] = {}
        for mb in self._micro_batches(batch):
            ref = None
            if self.reference is not None:
                with torch.no_grad(), replay.routes(self.reference, mb):
                    ref = token_logprobs(self.reference, mb, temperature, loss_only=True)  # (r, t)
            with replay.routes(self.model, mb):  # held through backward: checkpointed layers re-route there
                logp, entropy = token_logprobs(self.model, mb, temperature, loss_only=True, entropy=True)  # (r, t) x 2
                loss, metrics = actor_loss(logp, entropy, ref, mb, n, n_seq, self.cfg, self.is_correction)
                loss.backward()
            gap = (logp.detach() - mb.behaviour_logp).abs() * mb.loss_mask  # (r, t), before any update
            metrics |= {"mismatch/logprob_abs_mean": gap.sum() / n, "mismatch/logprob_abs_max": gap.max()}
            totals = combine(totals, metrics)
        if self.mesh is not None:
            totals = parallel.reduce_metrics(totals, self.device)
        out = dict(zip(totals, torch.stack([v.float() for v in totals.values()]).tolist()))  # one device sync
        out.update({"tokens/loss": float(local_loss_tokens), "tokens/total": float((batch.segment_ids >= 0).sum()),
                    "rows": float(batch.num_rows)})
        return out

    def train_step(self, segments: list[Segment], advantages: list, temperature: float = 1.0) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        metrics = self.backward(segments, advantages, temperature)
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        norm = float(self._clip_grad_norm(max_norm))
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"gradient norm is {norm}; step skipped (lower train.lr or set train.grad_clip)")
        self.optimizer.step()
        return dict(metrics, grad_norm=norm)

    def _micro_batches(self, batch: Batch) -> list[Batch]:
        """Micro-batches on the device: all of them on one rank; with a mesh, this data shard's (the same count on
        every rank) and, under context parallelism, this rank's slice of each (in the next-token alignment)."""
        if self.mesh is None:
            return [to_device(mb, self.device) for mb in micro_batches(batch, self.cfg.micro_batch_rows)]
        mbs = parallel.shard_micro_batches(batch, self.mesh, self.cfg.micro_batch_rows)
        cp = self.mesh["cp"]
        if cp.size() > 1:
            mbs = [cp_slice(align_next(mb), cp.size(), cp.get_local_rank())[0] for mb in mbs]
        return [to_device(mb, self.device) for mb in mbs]

    def _clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        if self.mesh is None:
            return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        norm = parallel.grad_norm(self.model.parameters(), self.device)
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # as clip_grad_norm_ does
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.device))
        return norm

    def _logprobs_cp(self, mb: Batch, temperature: float) -> torch.Tensor:
        """Whole-row log-probs (r, t) in the token alignment from this rank's CP slice (a collective over cp)."""
        cp = self.mesh["cp"]
        part = cp_slice(align_next(mb), cp.size(), cp.get_local_rank())[0]
        lp = token_logprobs(self.model, to_device(part, self.device), temperature)  # (r, t / cp), next-token
        return unalign(context.gather_columns(lp, cp.get_group(), mb.input_ids.shape[1]))  # (r, t)

    def logprobs(self, segments: list[Segment], temperature: float = 1.0) -> list[list[float]]:
        """Per-token log-probs of each segment under the current weights (0.0 at position 0). With a mesh every
        rank scores every segment (the same micro-batches everywhere, as collectives need)."""
        if self.mesh is not None and self.mesh["cp"].size() > 1:
            return per_token(lambda mb: self._logprobs_cp(mb, temperature), segments, self.cfg, "cpu")
        return segment_logprobs(self.model, segments, temperature, self.cfg, self.device)

    def export_weights(self) -> dict[str, torch.Tensor]:
        """fp32 CPU copies under the checkpoint's (= vLLM's) names (safe to write while training continues).
        `lm_head.weight` is always included: with tied embeddings an engine reloading weights keeps a stale head
        otherwise. With a mesh: full tensors on every rank (gathered; a collective).

        Gotcha: transformers fuses some checkpoint tensors on load (Qwen3-MoE's per-expert gate/up/down become
        3-D gate_up_proj/down_proj); an engine reloading the fused names silently keeps its old experts, so
        the conversion is reverted here, as save_pretrained does."""
        return revert_weight_conversion(self.model, parallel.full_tensors(self.model, head=True))

    def state_dict(self) -> dict:
        """The whole state on one rank; with a mesh, this rank's shards (restored only into the same layout)."""
        if self.mesh is not None:
            return parallel.local_state(self.model, self.optimizer)
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.mesh is not None:
            return parallel.load_local_state(self.model, self.optimizer, state)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
