"""Every actor rank's part of a checkpoint: its trained models and optimizers through torch.distributed.checkpoint
(DCP, Hugging Face safetensors storage, each rank writing its own shards) and its RNG. The run's directories,
atomicity and plain state are molt/checkpoint.py's.

    save_models({"policy": (model, optimizer)}, out_dir, mesh)   # collective: out_dir/policy/, out_dir/rng/
    load_models({"policy": (model, optimizer)}, in_dir, mesh)    # collective, whatever layout wrote in_dir

Tensors are saved under their global shapes (expert weights too: see `global_view`), so a checkpoint written by one
layout (dp2) resumes in another (dp1, ep2).
"""
from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_optimizer_state_dict)
from torch.distributed.tensor import DTensor, Shard

from molt.actor import lora
from molt.actor.master import MasterAdamW

# A 1-rank actor saves and loads in its own process, without a process group: DCP warns about that on every call,
# no_dist=True included (torch 2.13, state_dict_saver.save / state_dict_loader.load)
warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized", UserWarning)


def _rng_file(ckpt_dir: str) -> Path:
    return Path(ckpt_dir) / "rng" / f"rank_{dist.get_rank() if dist.is_initialized() else 0}.json"


def rng_state() -> dict:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state().tolist(), "python": [random.getstate()[0], list(random.getstate()[1]), None],
            "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)]}


def set_rng_state(s: dict) -> None:
    torch.set_rng_state(torch.tensor(s["torch"], dtype=torch.uint8))
    random.setstate((s["python"][0], tuple(s["python"][1]), None))
    kind, keys, pos, has_gauss, gauss = s["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))


def global_view(model, state: dict, mesh) -> dict:
    """The state with expert-parallel tensors as DTensors of their global shape over the whole (dp, ep, cp) mesh.

    Under fsdp.ep_size > 1 an expert weight (and its AdamW moments) is FSDP's DTensor of the rank's E/ep experts,
    sharded on dim 1 over the flattened (dp, cp) mesh. Seen from the 3-D mesh that is Shard(0) over ep and dim 1
    sharded by dp, then within it by cp: the same local block, now with global offsets, so DCP can reshard it into
    another ep size. Views only (from_local shares storage): loading into the view loads the parameter."""
    if mesh is None or mesh["ep"].size() == 1:
        return state
    owners = {f"{prefix}.{n}" for prefix, m in model.named_modules() if getattr(m, "ep_rank", None) is not None
              for n in ("gate_up_proj", "down_proj")}
    ep, shards = mesh["ep"].size(), mesh["dp"].size() * mesh["cp"].size()

    def view(key: str, t):
        if not (isinstance(t, DTensor) and key in owners):
            return t
        if t.shape[1] % shards:
            raise ValueError(f"{key}: dim 1 ({t.shape[1]}) must divide over dp x cp = {shards} for resharding")
        shape = (t.shape[0] * ep, *t.shape[1:])
        return DTensor.from_local(t.to_local(), mesh, [Shard(1), Shard(0), Shard(1)], run_check=False,
                                  shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())

    return {k: ({s: view(k, v) for s, v in t.items()} if isinstance(t, dict) else view(k, t)) for k, t in state.items()}


def untied(state: dict) -> dict:
    """`state` without the second name of a shared tensor (a tied head is the embedding: safetensors refuses to
    write one tensor twice, and loading the embedding loads the head, in place)."""
    seen, out = set(), {}
    for k, t in state.items():
        local = t.to_local() if isinstance(t, DTensor) else t
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape))
        if local.numel() == 0 or key not in seen:
            seen.add(key)
            out[k] = t
    return out


def _payload(model, optimizer, mesh) -> tuple[dict, dict]:
    model_sd = untied(get_model_state_dict(model))
    if lora.active(model):  # the frozen base is the model directory's: a checkpoint holds what LoRA trains
        trained = lora.trained_names(model)
        model_sd = {k: t for k, t in model_sd.items() if k in trained}
    optim_sd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=False))
    if isinstance(optimizer, MasterAdamW):  # the fp32 masters are the weights on disk, as with FSDP2's fp32 params
        params = dict(model.named_parameters(remove_duplicate=False))
        model_sd = {k: optimizer.state[params[k]]["master"] if params.get(k) in optimizer.state else t
                    for k, t in model_sd.items()}
        optim_sd["state"] = {k: {n: v for n, v in s.items() if n != "master"} for k, s in optim_sd["state"].items()}
    return {"model": global_view(model, model_sd, mesh), "optim": global_view(model, optim_sd["state"], mesh)}, optim_sd


def save_models(trained: dict, out_dir: str, mesh) -> None:
    """Collective: each trained model (name -> (model, optimizer)) under out_dir/name, plus this rank's RNG."""
    for name, (model, optimizer) in trained.items():
        payload, _ = _payload(model, optimizer, mesh)
        dcp.save(payload, storage_writer=dcp.HuggingFaceStorageWriter(f"{out_dir}/{name}", save_distributed=True))
    path = _rng_file(out_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rng_state()))


def load_models(trained: dict, in_dir: str, mesh) -> None:
    """Collective: restore each trained model and its optimizer from in_dir/name, whatever layout wrote it."""
    missing = [n for n in trained if not Path(in_dir, n).is_dir()]
    if missing:
        raise ValueError(f"the checkpoint holds no state for {missing}: it was written by a run with other helper "
                         "models (estimator / train.kl_coef) than this one")
    for name, (model, optimizer) in trained.items():
        payload, optim_sd = _payload(model, optimizer, mesh)  # views of the live tensors: loaded in place
        reader = dcp.HuggingFaceStorageReader(f"{in_dir}/{name}")
        saved = reader.read_metadata().state_dict_metadata
        for fqn in [f for f in optim_sd["state"] if f"optim.{f}.step" not in saved]:  # never stepped (no gradient)
            optim_sd["state"].pop(fqn), payload["optim"].pop(fqn, None)  # (one dict when no view was needed)
        dcp.load(payload, storage_reader=reader)
        set_optimizer_state_dict(model, optimizer, optim_sd,  # strict=False: the never-stepped ones stay stateless
                                 options=StateDictOptions(flatten_optimizer_state_dict=False, strict=False))
    rng = _rng_file(in_dir)
    if rng.is_file():  # a rank the writing layout did not have starts from its fresh RNG
        set_rng_state(json.loads(rng.read_text()))
