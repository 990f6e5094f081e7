"""Checkpoints that reshard: torch.distributed.checkpoint (DCP) in safetensors, plain JSON for everything else.

    checkpoint_dir/step_0000004/
        state.json             step, data position, layout, the driver's RNG (JSON: nothing in it can run)
        policy/, critic/       model + AdamW state of each trained model, every rank writing its own shards in
                               parallel (DCP's Hugging Face safetensors storage, sharding offsets in the headers)
        rng/rank_<r>.json      each actor rank's torch / numpy / python RNG
        hf/                    config and tokenizer files of the base model (for `export`)
        adapter/               LoRA runs: the adapters as a PEFT folder (policy/ then holds only them, and their AdamW)

Every rank's part (models, optimizers, RNG) is molt/actor/state.py's: tensors under their global shapes, so a
checkpoint written by one layout (dp2) resumes in another (dp1, ep2). Here: atomic, written to `.step_N.tmp` and
renamed once complete, so a crash mid-save leaves the previous checkpoint as the latest; the last `keep` are kept.
Nothing is unpickled on load: the safetensors reader takes its metadata from the JSON headers, and DCP's pickled
`.metadata` file is never written.

    python -m molt.checkpoint export CKPT OUT            # a Hugging Face directory (safetensors, config, tokenizer)
    python -m molt.checkpoint export CKPT OUT --merged   # LoRA: the base with the adapters merged in (else: the
                                                         # PEFT adapter folder, for peft or `vllm --lora-modules`)
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from molt.actor.state import rng_state, set_rng_state, untied

STATE = "state.json"


def save(ckpt_dir: str, step: int, actor, data_position: int, model_dir: str | Path, keep: int = 2) -> Path:
    """Write step `step` of `actor` (an Actor or ActorGroup: every rank writes its own shards) atomically. Called by
    the driver, or (torchrun, no driver) by every rank: rank 0 then does the directory work."""
    d = Path(ckpt_dir)
    final, tmp = d / f"step_{step:07d}", d / f".step_{step:07d}.tmp"
    lead = not dist.is_initialized() or dist.get_rank() == 0
    if lead:
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed save of the same step
        tmp.mkdir(parents=True)
    _barrier()
    actor.save(str(tmp))
    _barrier()  # every rank's files (its RNG is written after DCP's last collective) are in tmp before it moves
    if lead:
        shutil.copytree(model_dir, tmp / "hf", ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
        (tmp / STATE).write_text(json.dumps({"step": step, "data_position": data_position,
                                             "layout": list(actor.layout), "rng": rng_state()}))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in complete(d)[:-keep]:
            shutil.rmtree(old)
    _barrier()
    return final


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def complete(ckpt_dir: str | Path) -> list[Path]:
    return sorted(p for p in Path(ckpt_dir).glob("step_*") if (p / STATE).is_file())


def latest(ckpt_dir: str) -> Path | None:
    return next(reversed(complete(ckpt_dir)), None)


def load(path: str | Path, actor) -> dict:
    """Restore `actor` (any layout) and the driver's RNG from a checkpoint directory; returns its state.json."""
    path = Path(path)
    if not (path / STATE).is_file():
        raise ValueError(f"{path} is not a molt checkpoint directory (no {STATE}); files such as pickled .pt "
                         "checkpoints are never loaded, since loading them can run code")
    state = json.loads((path / STATE).read_text())
    actor.load(str(path))
    set_rng_state(state["rng"])
    return state


def export_hf(ckpt: str | Path, out_dir: str | Path, merged: bool = False) -> Path:
    """The checkpoint's policy as a Hugging Face directory (safetensors under the architecture's checkpoint names,
    config, tokenizer), e.g. to serve with vLLM or as the teacher of estimator=opd. Runs in one process.
    A LoRA checkpoint gives its PEFT adapter folder, or with `merged` the base model with the adapters merged in."""
    from transformers import AutoConfig

    from molt.actor.loading import empty_on, meta_model

    ckpt = Path(ckpt)
    if (ckpt / "adapter").is_dir():
        return export_lora(ckpt, Path(out_dir), merged)
    config = AutoConfig.from_pretrained(str(ckpt / "hf"))
    model = empty_on(meta_model(ckpt / "hf", getattr(torch, str(config.dtype).removeprefix("torch."))), "cpu")
    state = get_model_state_dict(model)  # a tied head's entry is its embedding's tensor: loaded with it, in place
    dcp.load({"model": untied(state)}, storage_reader=dcp.HuggingFaceStorageReader(str(ckpt / "policy")),
             no_dist=True)
    model.load_state_dict(state)
    shutil.copytree(ckpt / "hf", out_dir, dirs_exist_ok=True)  # tokenizer files; save_pretrained rewrites the config
    model.save_pretrained(str(out_dir))
    return Path(out_dir)


def export_lora(ckpt: Path, out_dir: Path, merged: bool) -> Path:
    """A LoRA checkpoint's adapter folder (copied), or its base (the adapter's base_model_name_or_path) merged by peft."""
    if not merged:
        shutil.copytree(ckpt / "adapter", out_dir, dirs_exist_ok=True)
        return out_dir
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = json.loads((ckpt / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, str(ckpt / "adapter")).merge_and_unload()
    shutil.copytree(ckpt / "hf", out_dir, dirs_exist_ok=True)
    model.save_pretrained(str(out_dir))
    return out_dir


if __name__ == "__main__":
    if len(sys.argv) not in (4, 5) or sys.argv[1] != "export" or sys.argv[4:] not in ([], ["--merged"]):
        raise SystemExit("usage: python -m molt.checkpoint export CKPT_DIR OUT_DIR [--merged]")
    print(export_hf(sys.argv[2], sys.argv[3], merged=sys.argv[4:] == ["--merged"]))
