"""Weight sync, the `reload` path: the actor's weights as safetensors in a directory every engine reads in place.

    await sync_weights(clients, actor.export_weights(), version, sync_dir, pause_mode)   # pause, reload, label, resume
    await sync_adapter(clients, actor.export_adapters(), cfg.lora, base, version, sync_dir, pause_mode)  # LoRA only
    diff = await verify_sync(clients[0], probe_ids, actor_logprobs, tol)                # the engine now agrees

The NCCL path (engine.sync=nccl) is molt/sync/nccl.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from molt.actor.lora import write_adapter
from molt.rollout.engine import EngineClient


def write_checkpoint(state_dict: dict[str, torch.Tensor], out_dir: str | Path) -> Path:
    """HF-named full tensors -> out_dir/model.safetensors (contiguous fp32 on CPU).

    vLLM's reload reads only the *.safetensors of the directory (no config.json). With tied
    embeddings the head is not reloaded unless lm_head.weight is in the file, so it is added.
    """
    from safetensors.torch import save_file

    tensors, seen = {}, set()
    for name, t in state_dict.items():
        t = t.detach().to("cpu", torch.float32).contiguous()
        if t.data_ptr() in seen:  # safetensors refuses tensors that share storage (tied weights)
            t = t.clone()
        seen.add(t.data_ptr())
        tensors[name] = t
    if "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    out = Path(out_dir)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@contextlib.asynccontextmanager
async def paused(clients: list[EngineClient], version: int, pause_mode: str = "wait", on_paused=None):
    """Every engine paused around a weight update (every sync path): on success their caches are dropped (the old
    weights computed the cached KV and vision encoder outputs) and the weights labelled `version`; they are resumed
    whatever happened. pause_mode (engine.pause_mode): wait lets the requests in flight finish on the old weights
    first; keep freezes them (dropping the caches preempts them: their KV is computed again) and they go on under the
    new ones, their later tokens labelled `version`. on_paused() runs once every engine is paused: a request sent
    from then on waits in the engine and runs on the new weights, labelled `version` (the loop gives the rollout
    worker its credits there, so that its next requests are ready when the engines resume)."""
    await asyncio.gather(*(c.pause(pause_mode) for c in clients))
    try:
        if on_paused is not None:
            on_paused()
        yield
        await asyncio.gather(*(c.drop_caches() for c in clients), *(c.set_version(version) for c in clients))
    finally:
        await asyncio.gather(*(c.resume() for c in clients), return_exceptions=True)


async def sync_weights(clients: list[EngineClient], state_dict: dict[str, torch.Tensor], version: int,
                       sync_dir: str | Path, pause_mode: str = "wait", on_paused=None) -> float:
    """Move the actor's weights into every engine (each reads them itself) and label them `version`; returns
    seconds. The engines read the directory themselves, so sync_dir must be on their machine (/dev/shm locally) or
    shared."""
    t0 = time.perf_counter()
    # the writer's pid in the name: a SIGKILL mid-sync leaves the directory, which molt/reaper.py sweep removes
    weights_dir = Path(tempfile.mkdtemp(prefix=f"molt-sync-{os.getpid()}-v{version}-", dir=sync_dir))
    try:
        write_checkpoint(state_dict, weights_dir)
        async with paused(clients, version, pause_mode, on_paused):
            await _on_all(clients, lambda c: c.reload_weights(weights_dir))
    finally:
        shutil.rmtree(weights_dir, ignore_errors=True)
    return time.perf_counter() - t0


async def _on_all(clients: list[EngineClient], call) -> None:
    done = await asyncio.gather(*(call(c) for c in clients), return_exceptions=True)
    for failure in (d for d in done if isinstance(d, BaseException)):  # once every engine has finished
        raise failure


async def sync_adapter(clients: list[EngineClient], adapters: dict[str, torch.Tensor], lora_cfg, base: str,
                       version: int, sync_dir: str | Path, pause_mode: str = "wait") -> float:
    """engine.sync=adapter: the LoRA adapters (full tensors, the actor's names) as a PEFT folder every engine loads as
    the policy (`--enable-lora`, /molt/load_adapter: molt/rollout/vllm_ext.py); the base weights never move. Returns
    seconds. The folder stays until the next version's is loaded: an engine reads it again if it ever evicts the
    adapter."""
    t0 = time.perf_counter()
    # molt/reaper.py sweeps what a SIGKILL leaves (the writer's pid in the name)
    adapter_dir = Path(sync_dir) / f"molt-sync-{os.getpid()}-v{version}-adapter"
    write_adapter(adapters, lora_cfg, base, adapter_dir)
    async with paused(clients, version, pause_mode):
        await _on_all(clients, lambda c: c.load_adapter(adapter_dir))
    drop_adapters(sync_dir, keep=adapter_dir)
    return time.perf_counter() - t0


def drop_adapters(sync_dir: str | Path, keep: Path | None = None) -> None:
    """This process's adapter folders in sync_dir, but `keep` (all of them once the engines are gone)."""
    for old in Path(sync_dir).glob(f"molt-sync-{os.getpid()}-v*-adapter"):
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


async def verify_sync(client: EngineClient, probe_ids: list[int], expected_logprobs: list[float], tol: float,
                      features: dict | None = None) -> float:
    """Max |engine - actor| log-prob on a probe sequence (with its images' `features`); raises when it exceeds tol."""
    got = await client.prompt_logprobs(probe_ids, features)
    assert len(got) == len(expected_logprobs), f"probe of {len(got)} log-probs vs {len(expected_logprobs)} expected"
    diff = max(abs(a - b) for a, b in zip(got, expected_logprobs))
    if diff > tol:
        raise RuntimeError(f"engine {client.name} disagrees with the actor after sync: max |dlogp| = {diff:.3e} > "
                           f"{tol:.1e}; the weights did not arrive (check the state-dict names and lm_head.weight)")
    return diff
