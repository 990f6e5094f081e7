"""Sharded model loading: build on the meta device, lay out, then each rank reads only its own shards.

    model = meta_model(model_dir, "bfloat16", "sdpa")   # no parameter storage
    parallel.parallelize(model, mesh, fsdp, ...)         # EP keeps E/ep experts, FSDP2 shards the rest
    materialize(model, model_dir, "cuda:0")              # this rank's slices, straight from the safetensors

No rank ever holds the full state dict: a dense tensor is read as the slice of it that this rank's DTensor shard
covers (`safe_open(...).get_slice`), an expert tensor from the per-expert checkpoint tensors of this rank's EP
shard only, fused with transformers' own conversion mapping of the architecture (Qwen3-MoE's
`experts.{e}.gate_proj/up_proj` -> `gate_up_proj`), then sliced for FSDP. Peak host memory per rank is its shards
plus one layer's local experts (experiments/benchmarks/load_memory.py measures it).
"""
from __future__ import annotations

import copy
import json
from collections import defaultdict
from pathlib import Path

import torch
from accelerate import init_empty_weights
from safetensors import safe_open
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import AutoConfig
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

from molt.actor import vision


def meta_model(model_dir: str | Path, dtype: torch.dtype, attn_implementation: str = "sdpa"):
    """The architecture of config.json with parameters on the meta device; buffers (rotary tables) are real, as
    the model's own __init__ computes them and no checkpoint holds them."""
    config = AutoConfig.from_pretrained(str(model_dir))
    with init_empty_weights(include_buffers=False):
        model = vision.model_class(model_dir).from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    model.tie_weights()  # init_empty_weights re-registers each parameter, which unties a tied head from the embedding
    return model


class SafetensorsDir:
    """Read slices of a Hugging Face directory's tensors under the model's own parameter names."""

    def __init__(self, model_dir: str | Path, model):
        d = Path(model_dir)
        index = d / "model.safetensors.index.json"
        files = json.loads(index.read_text())["weight_map"] if index.exists() else {
            k: f.name for f in sorted(d.glob("*.safetensors")) for k in safe_open(str(f), "pt").keys()}
        if not files:
            raise FileNotFoundError(f"{d} has no safetensors weights")
        self.handles = {f: safe_open(str(d / f), "pt", device="cpu") for f in set(files.values())}
        self.file_of, self.model = files, model
        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self.sources: dict[str, list[tuple[str, str | None]]] = defaultdict(list)  # param -> [(checkpoint key, pattern)]
        self.converter: dict[str, WeightConverter] = {}
        for key in sorted(files, key=dot_natural_key):
            target, pattern = rename_source_key(key, renamings, converters)
            self.sources[target].append((key, pattern))
            if pattern is not None:
                self.converter[target] = next(c for c in converters if pattern in c.source_patterns)

    def __contains__(self, name: str) -> bool:
        return name in self.sources

    def _get(self, key: str):
        return self.handles[self.file_of[key]].get_slice(key)

    def read(self, name: str, region: tuple[slice, ...]) -> torch.Tensor:
        """The `region` of parameter `name` (in the model's layout, e.g. experts (E, 2I, H))."""
        sources = self.sources[name]
        if name not in self.converter:
            (key, _), = sources
            return self._get(key)[region]
        # a fused tensor (experts stacked on dim 0): convert only the experts in region[0], then slice the rest
        conv = copy.deepcopy(self.converter[name])
        by_pattern = defaultdict(list)
        for key, pattern in sources:
            by_pattern[pattern].append(key)
        for pattern, keys in by_pattern.items():
            for key in keys[region[0]]:
                conv.add_tensor(name, key, pattern, self._get(key)[:])
        fused = conv.convert(name, model=self.model, config=self.model.config)[name]
        fused = fused[0] if isinstance(fused, list) else fused
        return fused[(slice(None), *region[1:])]


def local_region(model, name: str, p: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """(this rank's storage of p, the region of the checkpoint tensor it holds): the DTensor shard's offset, plus
    the EP offset of an expert tensor (parallel.shard_experts keeps experts [ep_rank * E/ep, (ep_rank + 1) * E/ep))."""
    if isinstance(p, DTensor):
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        local = p.to_local()
    else:
        shape, offset, local = p.shape, (0,) * p.ndim, p
    owner = model.get_submodule(name.rpartition(".")[0])
    offset = list(offset)
    if getattr(owner, "ep_rank", None) is not None:
        offset[0] += owner.ep_rank * p.shape[0]
    return local, tuple(slice(o, o + n) for o, n in zip(offset, shape))


@torch.no_grad()
def empty_on(model, device):
    """Uninitialised parameter storage on `device` for a meta_model, its (computed) buffers kept."""
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives each module a new tensor: a tied head would come apart from the embedding
    for n, b in model.named_buffers():
        b.copy_(buffers[n])
    return model


@torch.no_grad()
def materialize(model, model_dir: str | Path, device, fresh: tuple[str, ...] = ()) -> None:
    """Allocate this rank's shards on `device` and fill them from the safetensors of `model_dir`; parameters under
    whose name holds a `fresh` part (modules added to the architecture: a value head, LoRA adapters) start at zero."""
    model = empty_on(model, device)
    ckpt = SafetensorsDir(model_dir, model)
    missing = []
    for name, p in [*model.named_parameters(), *model.named_buffers()]:  # deduplicated: a tied head is the embedding
        local, region = local_region(model, name, p)
        key = name.replace(".base_layer.", ".")  # a LoRA layer (peft) holds the checkpoint's weight one level down
        if any(f in name for f in fresh):
            local.zero_()
        elif key in ckpt:
            local.copy_(ckpt.read(key, region))
        elif isinstance(p, torch.nn.Parameter):  # a buffer no checkpoint holds (rotary tables) keeps its value
            missing.append(name)
    if missing:
        raise KeyError(f"{model_dir}: no checkpoint tensor for {missing[:5]} ({len(missing)} in all)")
