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
from transformers.core_model_loading import revert_weight_conversion

from molt.actor import attention, context, loading, lora, parallel, speed, vision
from molt.actor import replay as replay_mod
from molt.actor.master import MasterAdamW
from molt.actor.state import load_models, save_models
from molt.actor.pack import (NO_TARGET, align_next, cp_slice, micro_batches, pack, scatter_loss_tokens, to_device,
                              unalign)
from molt.algo.loss import Objective, combine
from molt.types import Batch, Segment

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from molt.config import FsdpConfig, LoraConfig, TrainConfig

ATTENTION = (attention.NAME, "sdpa", "eager", "flex_attention")  # all honour packed rows through position_ids (pack.py)
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
    out = model.get_decoder()(**vision.inputs(model, batch), position_ids=batch.position_ids, use_cache=False,
                              **context.forward_kwargs(model, batch))
    hidden = out.last_hidden_state  # (R, T, H)
    lp, ent = head_logprobs(model.get_output_embeddings(), hidden[rows, cols - back], targets[rows, cols],
                            temperature, entropy=entropy, fn=getattr(model, "molt_head_fn", _chosen_logprobs))
    scatter = lambda x: torch.zeros(want.shape, dtype=x.dtype, device=x.device).index_put((rows, cols), x)  # noqa: E731
    return (scatter(lp), scatter(ent)) if entropy else scatter(lp)  # (R, T)


def load_model(model_dir: str | Path, dtype: str, attn_implementation: str, device, trainable: bool = True,
               freeze_vision: bool = False):
    """The whole Hugging Face causal LM (or vision-language model, vision.py) on one device, in eval mode (no dropout:
    its forward is the engine's); frozen unless trainable. The transforms (checkpointing, compile, replay, layout)
    are parallel.parallelize's. MoE experts run transformers' default "grouped_mm" implementation (speed.py says why)."""
    on_gpu = {"device_map": str(device)} if torch.device(device).type == "cuda" else {}  # tensor by tensor to it
    model = vision.model_class(model_dir).from_pretrained(str(model_dir), dtype=_dtype(dtype), **on_gpu,
                                                          attn_implementation=attn_implementation).to(device)
    model.eval().requires_grad_(trainable)
    vision.attach(model, model_dir, freeze=freeze_vision)
    return model


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


def _zeros(module: torch.nn.Module) -> torch.nn.Module:
    for p in module.parameters():
        torch.nn.init.zeros_(p)
    return module


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"model.dtype={name!r} is not a torch dtype (use float32 or bfloat16)")
    return dtype


class Actor:
    """One rank of the policy. Without a mesh: the plain single-process actor (the numerical reference). With a
    mesh (one per rank, see molt/actor/group.py): the model is parallelized (molt/actor/parallel.py), every rank
    receives the whole batch and trains its own data shard, and every method is a collective.

    `objective` (molt/algo/loss.py Objective) is the whole loss, chosen by the run; the helper models it or the
    estimator needs (molt/actor/helpers.py) are built with `add_helper` on this actor's device and layout.
    With lora_cfg.rank > 0 the policy trains LoRA adapters on its frozen base (molt/actor/lora.py)."""

    def __init__(self, model_dir: str | Path, train: TrainConfig, dtype: str = "float32",
                 attn_implementation: str | None = None, device: str = "cpu", objective=None,
                 fsdp: FsdpConfig | None = None, mesh: DeviceMesh | None = None, master: bool | None = None,
                 lora_cfg: LoraConfig | None = None):
        # a vision tower attends under its own padding mask, which molt_varlen (no mask function) would drop
        attn_implementation = attn_implementation or ("sdpa" if vision.is_vision(model_dir) else
                                                      speed.fast_attention(device))
        if attn_implementation not in ATTENTION:
            raise ValueError(f"attn_implementation={attn_implementation!r}: use one of {ATTENTION}")
        if train.num_threads > 0:
            torch.set_num_threads(train.num_threads)
        self.cfg, self.device, self.mesh, self.fsdp = train, torch.device(device), mesh, fsdp
        self.dtype, self.attn = dtype, attn_implementation
        # fp32 on one GPU: bf16 compute, the fp32 masters in the optimizer (master.py; on CPU only when asked)
        self.master = (self.device.type == "cuda" and mesh is None and dtype == "float32") if master is None else master
        self.objective = objective or Objective()
        self.helpers: dict = {}
        self.transfer = None  # engine.sync=nccl: the trainer side of the engines' group (molt/sync/nccl.py)
        self.kept: list[list[float]] | None = None  # train_step(keep_logprobs=True): per segment, its log-probs
        self.model_dir, self.lora = str(model_dir), lora_cfg if lora_cfg is not None and lora_cfg.rank > 0 else None
        self.model = self.build(model_dir, trainable=True, replay=train.routing_replay, adapters=self.lora)
        self.optimizer = self.adamw(self.model, train.lr)

    def adamw(self, model, lr: float) -> torch.optim.Optimizer:
        """The optimizer of a trained model: MasterAdamW (casts the model to bf16) when self.master; else AdamW,
        fused on the GPU (one kernel for the whole update: foreach AdamW took a quarter of an MoE step there) and on
        one CPU process (the quickstart's update 0.76 -> 0.22 ms, the clip inside it)."""
        kw = dict(lr=lr, betas=tuple(self.cfg.betas), weight_decay=self.cfg.weight_decay)
        if self.master:
            return MasterAdamW(model.parameters(), compile=self.device.type == "cuda", **kw)
        on_gpu = self.device.type == "cuda" and (self.fsdp is None or self.fsdp.offload != "optimizer")
        return torch.optim.AdamW(model.parameters(), fused=on_gpu or (self.mesh is None) or None, **kw)

    def build(self, model_dir, trainable: bool, replay: bool, fresh: dict | None = None, adapters=None):
        """A model (the policy or a helper) in this actor's dtype, device and layout. Without a mesh it is loaded
        whole (the numerical reference); with one it is built on the meta device, laid out, and each rank reads only
        its own shards (molt/actor/loading.py). fresh: name -> fn(model) -> module to add, zero-initialised.
        adapters: a LoraConfig: LoRA adapters on the frozen model, put in before the layout (lora.py)."""
        fresh = fresh or {}
        layout = dict(checkpointing=trainable and self.cfg.activation_checkpointing, replay=replay,
                      compile_head=_chosen_logprobs if self.cfg.compile else None,
                      mixed_precision=self.device.type == "cuda" and self.dtype == "float32")
        if self.mesh is None:  # self.master: a frozen model in bf16; a trained one in fp32 until adamw() casts it
            dtype = "bfloat16" if self.master and not trainable else self.dtype
            model = load_model(model_dir, dtype, self.attn, self.device, trainable, self.cfg.freeze_vision)
            for name, make in fresh.items():
                setattr(model, name, _zeros(make(model)).to(self.device).requires_grad_(trainable))
            if adapters is not None:
                lora.init_adapters(lora.inject(model, adapters), adapters.seed)
            return parallel.parallelize(model, None, **layout)
        model = loading.meta_model(model_dir, _dtype(self.dtype), self.attn)
        for name, make in fresh.items():
            setattr(model, name, make(model).to("meta"))
        if adapters is not None:
            lora.inject(model, adapters)
        parallel.parallelize(model, self.mesh, self.fsdp, **layout)
        # offloaded shards live on the host (FSDP2 CPUOffloadPolicy); the rest on this rank's device
        offload = self.fsdp is not None and self.fsdp.offload == "optimizer"
        loading.materialize(model, model_dir, "cpu" if offload else self.device,
                            fresh=(*fresh, *((".lora_A.", ".lora_B.") if adapters is not None else ())))
        model.eval().requires_grad_(trainable)
        vision.attach(model, model_dir, freeze=self.cfg.freeze_vision)
        if adapters is not None:
            lora.init_adapters(lora.freeze_base(model, adapters), adapters.seed)
        return model

    def backward(self, segments: list[Segment], advantages: list, temperature: float = 1.0,
                 num_loss_tokens: int | None = None, num_sequences: int | None = None,
                 keep: torch.Tensor | None = None) -> dict[str, float]:
        """Accumulate the batch's policy gradient into .grad (no step). num_loss_tokens and num_sequences
        (segments with loss tokens) default to this batch's counts; data-parallel callers pass all-ranks totals.
        keep: every segment's tokens end to end, on the device; the loss tokens this rank computes get the log-prob
        its loss used."""
        batch = pack(segments, advantages, self.cfg.row_tokens, share=self.shares_prefix())
        if keep is not None:
            starts = torch.tensor([0] + [len(s.token_ids) for s in segments], device=self.device).cumsum(0)
        local_loss_tokens = int(batch.loss_mask.sum())
        n = num_loss_tokens or local_loss_tokens
        if n == 0:
            raise ValueError("the batch has no generated (loss-mask 1) tokens to train on")
        n_seq = num_sequences or sum(s.num_generated > 0 for s in segments)
        totals: dict[str, torch.Tensor] = {}
        mbs = self.micro_batches(batch)
        self.optimizer.stash = len(mbs) > 1  # MasterAdamW: several micro-batches accumulate in fp32
        for mb in mbs:
            with torch.no_grad():  # helper scores the objective takes (the KL reference's log-probs), (r, t) each: on
                # the loss tokens only, as the policy's (the head over every prompt position was most of a KL step)
                aux = {n: self.helpers[n].score(mb, temperature, loss_only=True) for n in self.objective.needs}
            # held through backward: checkpointed layers re-route (and re-drop: lora.dropout) there
            with replay_mod.routes(self.model, mb), lora.dropout_on(self.model):
                logp, entropy = token_logprobs(self.model, mb, temperature, loss_only=True, entropy=True)  # (r, t) x 2
                loss, metrics = self.objective(logp, entropy, mb, n, n_seq, **aux)
                loss.backward()
            if keep is not None:
                scatter_loss_tokens(keep, mb, logp.detach(), starts)
            gap = (logp.detach() - mb.behaviour_logp).abs() * mb.loss_mask  # (r, t), before any update
            metrics |= {"mismatch/logprob_abs_mean": gap.sum() / n, "mismatch/logprob_abs_max": gap.max()}
            totals = combine(totals, metrics)
        return self.reduce(totals) | {"tokens/loss": float(local_loss_tokens),
                                      "tokens/total": float((batch.segment_ids >= 0).sum()),
                                      "rows": float(batch.num_rows)}

    def shares_prefix(self) -> bool:
        """Whether the train step packs equal prompts once (train.share_prefix; pack.py): molt_varlen only reads
        them, and context parallelism's mask (context.py) knows segments, not shared prefixes."""
        cp = self.mesh is not None and self.mesh["cp"].size() > 1
        return self.cfg.share_prefix and self.attn == attention.NAME and not cp

    def reduce(self, totals: dict[str, torch.Tensor]) -> dict[str, float]:
        """Metric totals of this rank's micro-batches -> floats over all ranks, with one device sync."""
        if self.mesh is not None:
            totals = parallel.reduce_metrics(totals, self.device)
        return dict(zip(totals, torch.stack([v.float() for v in totals.values()]).tolist())) if totals else {}

    def train_step(self, segments: list[Segment], advantages: list, temperature: float = 1.0,
                   keep_logprobs: bool = False) -> dict[str, float]:
        """One optimizer step on the batch. keep_logprobs: also keep the actor's log-prob of every generated token
        as this step's loss saw it (before the update), for kept_logprobs (the trajectory page, molt/view.py); it
        costs a gather over the ranks and a transfer, so only the steps that show it ask."""
        self.optimizer.zero_grad(set_to_none=True)
        lengths = [len(s.token_ids) for s in segments]
        keep = torch.full((sum(lengths),), -math.inf, device=self.device) if keep_logprobs else None
        metrics = self.backward(segments, advantages, temperature, keep=keep)
        self.kept = None if keep is None else self._gathered(keep, lengths)
        norm = float(self.clip_grads(self.model.parameters(), self.optimizer))
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"gradient norm is {norm}; step skipped (lower train.lr or set train.grad_clip)")
        lr = self.warmed_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        return dict(metrics, grad_norm=norm, lr=lr)

    def warmed_lr(self) -> float:
        """train.lr, ramped linearly over the first train.warmup_steps updates. The count is AdamW's own step (every
        trained parameter's state keeps it), so a resumed run goes on where its checkpoint stopped."""
        if self.cfg.warmup_steps <= 0:
            return self.cfg.lr
        done = float(next(iter(self.optimizer.state.values()), {}).get("step", 0))
        return self.cfg.lr * min(1.0, (done + 1) / self.cfg.warmup_steps)

    def _gathered(self, keep: torch.Tensor, lengths: list[int]) -> list[list[float]]:
        """Kept log-probs from every rank (each loss token was computed by one rank, -inf elsewhere: a max gathers
        them), one list per segment, 0.0 off the loss mask as the behaviour log-probs are."""
        if self.mesh is not None:
            keep = parallel.reduce_metrics({"kept_max": keep}, self.device)["kept_max"]
        keep = torch.where(torch.isneginf(keep), 0.0, keep).cpu()
        return [x.tolist() for x in keep.split(lengths)]

    def kept_logprobs(self) -> list[list[float]] | None:
        """Per segment, the actor's log-probs of the last train_step(keep_logprobs=True); None if it kept none."""
        return self.kept

    def train_helpers(self, segments: list[Segment], targets: dict[str, list[list[float]]]) -> dict[str, float]:
        """One step of every trainable helper that has per-token targets this step (the gae critic's returns)."""
        out = {}
        for name, per_segment in targets.items():
            out |= self.helpers[name].train_step(segments, per_segment)
        return out

    def micro_batches(self, batch: Batch) -> list[Batch]:
        """Micro-batches on the device: all of them on one rank; with a mesh, this data shard's (the same count on
        every rank) and, under context parallelism, this rank's slice of each (in the next-token alignment)."""
        if self.mesh is None:
            return [to_device(mb, self.device) for mb in micro_batches(batch, self.cfg.micro_batch_rows)]
        mbs = parallel.shard_micro_batches(batch, self.mesh, self.cfg.micro_batch_rows)
        cp = self.mesh["cp"]
        if cp.size() > 1:
            mbs = [cp_slice(align_next(mb), cp.size(), cp.get_local_rank())[0] for mb in mbs]
        return [to_device(mb, self.device) for mb in mbs]

    def clip_grads(self, params, optimizer=None) -> torch.Tensor:
        """Clip the global gradient norm to train.grad_clip (0 = no clipping); returns the norm before clipping.
        With a fused `optimizer` the clip rides in its kernel: it divides each gradient by the optimizer's
        `grad_scale` (AMP's unscaling hook) in the update's own pass and stores it back, so the gradients end up
        clipped as below without one more read and write of every fp32 gradient."""
        params = list(params)
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        fused = optimizer is not None and (optimizer.param_groups[0].get("fused") or isinstance(optimizer, MasterAdamW))
        if self.mesh is None and not fused:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        grads = optimizer.grads() if isinstance(optimizer, MasterAdamW) else [p.grad for p in params if p.grad is not None]
        norm = parallel.grad_norm(params, self.device) if self.mesh is not None else \
            torch.nn.utils.get_total_norm(grads, foreach=True)
        if fused:
            optimizer.grad_scale = ((norm + 1e-6) / max_norm).clamp(min=1.0).float()  # 1 / clip_grad_norm_'s coef
            return norm
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # as clip_grad_norm_ does
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in parallel.local_grads(params):  # offloaded grads live on the host
            by_device.setdefault(g.device, []).append(g)
        for device, grads in by_device.items():
            torch._foreach_mul_(grads, coef.to(device))
        return norm

    def _per_token(self, fn, segments: list[Segment]) -> list[list[float]]:
        """fn(micro-batch) -> (r, t) per-token values, over every segment, one list per segment. With a mesh every
        rank scores every segment (the same micro-batches everywhere, as collectives need); under context
        parallelism each rank computes its slice of each row (next-token alignment) and the slices are gathered."""
        if self.mesh is None or self.mesh["cp"].size() == 1:
            return per_token(fn, segments, self.cfg, self.device)
        cp = self.mesh["cp"]

        def sliced(mb: Batch) -> torch.Tensor:  # (r, t) in the token alignment, from this rank's slice (a collective)
            part = cp_slice(align_next(mb), cp.size(), cp.get_local_rank())[0]
            x = fn(to_device(part, self.device))  # (r, t / cp), next-token alignment
            return unalign(context.gather_columns(x, cp.get_group(), mb.input_ids.shape[1]))

        return per_token(sliced, segments, self.cfg, "cpu")  # sliced on the host, computed on the device

    def logprobs(self, segments: list[Segment], temperature: float = 1.0) -> list[list[float]]:
        """Per-token log-probs of each segment under the current weights (0.0 at position 0)."""
        return self._per_token(lambda mb: token_logprobs(self.model, mb, temperature), segments)

    def score(self, segments: list[Segment], names, temperature: float = 1.0) -> dict[str, list[list[float]]]:
        """Per-token outputs of the named helpers on each segment (0.0 where nothing is predicted): a teacher's
        log-probs, a critic's values (for the estimator's per-token inputs)."""
        return {n: self._per_token(lambda mb, h=self.helpers[n]: h.score(mb, temperature), segments) for n in names}

    def export_weights(self) -> dict[str, torch.Tensor]:
        """fp32 CPU copies under the checkpoint's (= vLLM's) names (safe to write while training continues).
        `lm_head.weight` is always included: with tied embeddings an engine reloading weights keeps a stale head
        otherwise. With a mesh: full tensors on every rank (gathered; a collective).

        Gotcha: transformers fuses some checkpoint tensors on load (Qwen3-MoE's per-expert gate/up/down become
        3-D gate_up_proj/down_proj); an engine reloading the fused names silently keeps its old experts, so
        the conversion is reverted here, as save_pretrained does.
        With LoRA: only the adapted weights, merged (W + alpha/r B A), the ones vLLM fuses with them and the modules
        trained in full (lora.py)."""
        if self.lora is not None:
            return lora.merged(self.model, parallel.full_tensors(self.model, only=lora.sync_names(self.model)))
        return revert_weight_conversion(self.model, parallel.full_tensors(self.model, head=True))

    def export_adapters(self) -> dict[str, torch.Tensor]:
        """LoRA: the full tensors of the adapters (and lora.modules_to_save), fp32 on the host (engine.sync=adapter,
        the checkpoint's PEFT folder; a collective with a mesh)."""
        return parallel.full_tensors(self.model, only=lora.trained_names(self.model))

    def apply(self, fn, *args):
        """fn(self, *args): how a layer above the actor (the weight sync, molt/sync/) runs its code on the actor,
        on every rank of an ActorGroup."""
        return fn(self, *args)

    def _trained(self) -> dict:
        return {"policy": (self.model, self.optimizer)} | {
            n: (h.model, h.optimizer) for n, h in self.helpers.items() if hasattr(h, "optimizer")}

    @property
    def layout(self) -> tuple[int, int, int]:
        f = self.fsdp
        return (f.dp_size, f.ep_size, f.cp_size) if f is not None and self.mesh is not None else (1, 1, 1)

    def save(self, path: str) -> None:
        """Write the policy and trainable helpers (model + optimizer) under path (state.py; with LoRA the adapters
        and their optimizer state only); with a mesh a collective, every rank writing its own shards."""
        save_models(self._trained(), path, self.mesh)
        if self.lora is not None:  # and as a PEFT adapter folder, what `python -m molt.checkpoint export` hands out
            full = self.export_adapters()
            if self.mesh is None or torch.distributed.get_rank() == 0:
                lora.write_adapter(full, self.lora, self.model_dir, f"{path}/adapter")

    def load(self, path: str) -> None:
        """Restore from a checkpoint written by any layout (a collective with a mesh)."""
        load_models(self._trained(), path, self.mesh)
