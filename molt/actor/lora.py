"""LoRA (`lora.rank > 0`): peft's low-rank adapters on the frozen base model; the actor trains, checkpoints and syncs
only them.

    refused = problem(meta_model, cfg.lora)       # the guard rail: unknown targets, a rank too large, experts
    inject(model, cfg.lora)                       # before the layout: each targeted nn.Linear -> peft's lora.Linear
    init_adapters(model, cfg.lora.seed)           # after it: A kaiming-uniform from the seed, B = 0, on any layout
    with disabled(model): ...                     # the base model's forward: the KL reference, without a second copy
    merged(model, full)                           # W + alpha/r B A of every targeted weight, under the HF names
                                                  # (and cfg.modules_to_save: modules trained in full beside them)
    write_adapter(full, cfg.lora, base, out_dir)  # a PEFT adapter folder (peft, and vLLM's LoRA loading, read it)

peft inserts `.base_layer` into the base weight's name and adds `lora_A.default` / `lora_B.default`; the module
tree is otherwise the model's own (inject_adapter_in_model, not PeftModel), so FSDP2, EP and CP wrap it unchanged.
peft is imported by the first injection only: importing it costs seconds in every process of a run.
"""
from __future__ import annotations

import contextlib
import json
import math
import sys
from pathlib import Path

import torch

ADAPTER = "default"  # peft's adapter name inside the module tree; PEFT folders drop it
# vLLM fuses these projections into one tensor (qkv_proj, gate_up_proj): a reload that brings one of them rebuilds
# the fused tensor from what it got, so a merged sync sends all of a group's weights or none
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def peft_config(cfg, saved: bool = False):
    """peft's LoraConfig of cfg; `saved`: with modules_to_save, for the folder written (injecting them would wrap each
    in peft's ModulesToSaveWrapper and rename its weights; the actor trains them in place instead, freeze_base)."""
    from peft import LoraConfig

    return LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, bias="none",
                      target_modules=list(cfg.target_modules),
                      modules_to_save=list(cfg.modules_to_save) or None if saved else None)


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def saved(model, cfg) -> dict[str, torch.nn.Module]:
    """name -> module for every module cfg.modules_to_save trains in full (peft's rule: the name ends with it)."""
    return {n: m for n, m in model.named_modules() if n and any(n.endswith(t) for t in cfg.modules_to_save)}


def targets(model, cfg) -> dict[str, torch.nn.Module]:
    """name -> module for every module a target name matches (peft's rule: the name or its last dotted parts)."""
    return {n: m for n, m in model.named_modules() for t in cfg.target_modules if n == t or n.endswith("." + t)}


def problem(model, cfg) -> str | None:
    """Why `cfg` cannot adapt `model` (a meta-device model will do), or None."""
    from molt.actor.parallel import expert_modules

    found, layers = targets(model, cfg), model.get_decoder().layers
    leaves = sorted({n.rpartition(".")[2] for n, m in layers.named_modules() if isinstance(m, torch.nn.Linear)})
    unknown = [t for t in cfg.target_modules if not any(n == t or n.endswith("." + t) for n in found)]
    if unknown:
        return f"lora.target_modules: {unknown} name no module of the model; its decoder's linear layers are {leaves}"
    inside = {id(m) for m in layers.modules()}
    for name, m in found.items():
        if not isinstance(m, torch.nn.Linear) or id(m) not in inside:
            where = "" if id(m) in inside else " outside the decoder layers"
            return (f"lora.target_modules: {name} is a {type(m).__name__}{where}: "
                    f"LoRA adapts the decoder layers' linear layers only (embeddings, head and fused MoE experts are "
                    f"refused: vLLM has no CPU LoRA kernel for experts); choose among {leaves}")
        if expert_modules(model) and ".self_attn." not in f".{name}.":
            return (f"lora.target_modules: {name} is outside the attention of an MoE model: LoRA on MoE models adapts "
                    "the attention projections only (the router would change the engine's routing, and the fused "
                    "experts have no LoRA kernel on vLLM's CPU build): choose among q_proj, k_proj, v_proj, o_proj")
        if cfg.rank > min(m.in_features, m.out_features):
            return (f"lora.rank={cfg.rank} exceeds the dimensions of {name} ({m.in_features} -> {m.out_features}): "
                    f"a rank above {min(m.in_features, m.out_features)} adds nothing; lower lora.rank")
    full, tops = saved(model, cfg), sorted(n for n, m in model.named_modules() if "layers" not in n and n and
                                           next(m.parameters(recurse=False), None) is not None)
    unknown = [t for t in cfg.modules_to_save if not any(n.endswith(t) for n in full)]
    if unknown:
        return f"lora.modules_to_save: {unknown} name no module of the model; outside its layers it has {tops}"
    both = sorted(n for n in full if any(n == t or n.startswith(t + ".") or t.startswith(n + ".") for t in found))
    tied = getattr(model.config, "tie_word_embeddings", False) and [
        n for n in full if n.endswith(("lm_head", "embed_tokens"))]
    if both or tied:
        return (f"lora.modules_to_save: {both or tied} " + ("overlap lora.target_modules: a module is adapted or "
                "trained in full, not both" if both else "are tied (tie_word_embeddings): training the head trains "
                "the embeddings, which vLLM reads for both; train another module or use full fine-tuning"))


def inject(model, cfg):
    """Freeze the base, put an adapter on every target (on the meta device too: materialize fills it)."""
    from peft import inject_adapter_in_model

    inject_adapter_in_model(peft_config(cfg), model, adapter_name=ADAPTER)
    return freeze_base(model, cfg)


def freeze_base(model, cfg):
    """Gradients (hence optimizer state) for the adapters and cfg.modules_to_save only."""
    full = tuple(f"{n}." for n in saved(model, cfg))
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name) or name.startswith(full))
    return model


def trained_names(model) -> set[str]:
    """The parameters a LoRA run trains, saves and exports: the adapters and the modules trained in full."""
    return {n for n, p in model.named_parameters() if p.requires_grad}


def layers(model) -> dict[str, torch.nn.Module]:
    """name -> peft LoRA layer of the model (none before peft was imported: only inject imports it)."""
    if "peft" not in sys.modules:
        return {}
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def active(model) -> bool:
    return bool(layers(model))


@torch.no_grad()
def init_adapters(model, seed: int) -> None:
    """A ~ kaiming-uniform(a=sqrt(5)) (peft's default), B = 0, drawn in full from one generator in parameter order and
    sliced to this rank's shard: every layout starts from the same adapters as one rank."""
    from molt.actor.loading import local_region

    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if is_adapter(name):
            full = torch.zeros(p.shape, dtype=torch.float32)
            if ".lora_A." in name:
                torch.nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=g)
            local, region = local_region(model, name, p)
            local.copy_(full[region])


@contextlib.contextmanager
def disabled(model):
    """The base model's forward inside (adapters bypassed). `_disable_adapters` is the flag peft's own
    enable_adapters sets; that method would also flip requires_grad on the (FSDP-managed) adapter parameters."""
    adapted = layers(model).values()
    for m in adapted:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m in adapted:
            m._disable_adapters = False


@contextlib.contextmanager
def dropout_on(model):
    """lora.dropout in the training forward only: the model stays in eval mode, its adapters' dropout trains."""
    drops = [d for m in layers(model).values() for d in m.lora_dropout.values()]
    for d in drops:
        d.train()
    try:
        yield
    finally:
        for d in drops:
            d.eval()


def sync_names(model) -> set[str]:
    """The state-dict names a merged sync needs: each adapted module's base weight and adapters, the weights of
    the projections vLLM fuses with an adapted one, and the modules trained in full (modules_to_save)."""
    adapted = set(layers(model))
    need = set(adapted)
    for name in adapted:
        parent, _, leaf = name.rpartition(".")
        need |= {f"{parent}.{s}" for group in FUSED if leaf in group for s in group}
    return {k for k in model.state_dict() if module_of(k) in need and (is_adapter(k) or k.endswith(".weight"))} | {
        k for k in trained_names(model) if not is_adapter(k)}


def module_of(key: str) -> str:
    """The module a state-dict key belongs to, a LoRA layer's adapters and base weight included."""
    return key.split(".lora_")[0] if is_adapter(key) else key.rpartition(".")[0].removesuffix(".base_layer")


def merged(model, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full tensors of sync_names -> HF-named weights, W + scaling B A where adapted (peft's scaling: alpha / r)."""
    out = {}
    for key, w in full.items():
        if is_adapter(key):
            continue
        module, name = module_of(key), key.replace(".base_layer.", ".")
        if f"{module}.lora_A.{ADAPTER}.weight" in full:
            a, b = full[f"{module}.lora_A.{ADAPTER}.weight"], full[f"{module}.lora_B.{ADAPTER}.weight"]
            w = w + model.get_submodule(module).scaling[ADAPTER] * (b @ a)
        out[name] = w
    return out


def adapter_tensors(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters (and modules_to_save) under PEFT's file names: base_model.model.<module>.lora_A.weight, and
    base_model.model.<module>.weight for a module trained in full."""
    return {f"base_model.model.{k.replace(f'.{ADAPTER}.', '.')}": t.contiguous() for k, t in full.items()}


def write_adapter(full: dict[str, torch.Tensor], cfg, base: str | Path, out_dir: str | Path) -> Path:
    """A PEFT adapter folder: adapter_config.json + adapter_model.safetensors."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    conf = peft_config(cfg, saved=True).to_dict() | {"base_model_name_or_path": str(base), "peft_type": "LORA"}
    conf["target_modules"] = sorted(conf["target_modules"])  # a set in peft's dict
    (out / "adapter_config.json").write_text(json.dumps(conf, indent=1, default=str))
    save_file(adapter_tensors(full), str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    return out

