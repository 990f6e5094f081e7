"""fp32 master weights in the optimizer, for a model that computes in bf16 on one GPU.

    opt = MasterAdamW(model.parameters(), lr=1e-6, compile=True)  # fp32 params in: masters kept, params cast to bf16
    opt.stash = n_micro_batches > 1   # gradients of several micro-batches accumulate in fp32, not in bf16
    opt.grad_scale = norm / max_norm  # optional: the clip, applied inside the update
    opt.step()                        # AdamW on the fp32 masters, written back to the bf16 params in the same pass

What FSDP2's mixed-precision policy gives at several ranks (fp32 masters and moments, bf16 compute, fp32 gradient
accumulation) without its world-size-1 copies and casts: the update reads the bf16 gradient, the fp32 master and
both moments once and writes them and the bf16 parameter once (on the GPU one compiled kernel per tensor), about
28 bytes per parameter where FSDP2 + a fused fp32 AdamW move about 58 (docs/gpu.md). The masters are the weights a
checkpoint holds (molt/actor/state.py) and the moments stay fp32 through it.
"""
from __future__ import annotations

import functools
import weakref

import torch

_HALF = torch.bfloat16


def _adamw(p, g, master, m, v, s, scale):
    """One AdamW update as torch.optim.AdamW computes it, on fp32 `master` from `g` / `scale`, written to `p`.
    s = (lr, beta1, beta2, eps, weight_decay, 1 - beta1^t, 1 - beta2^t), a tensor: no recompile as t moves."""
    g = g.float() / scale
    m.lerp_(g, 1 - s[1])
    v.mul_(s[2]).add_((1 - s[2]) * g * g)
    master.mul_(1 - s[0] * s[4])
    master.sub_(s[0] / s[5] * m / (v.sqrt() / s[6].sqrt() + s[3]))
    p.copy_(master)


def _accumulate(optimizer: weakref.ref, p) -> None:
    """With several micro-batches (`stash`), each one's bf16 gradient is added into an fp32 buffer at once. (The
    hook lives in autograd's C++ graph, out of Python's cycle collector: it holds the optimizer weakly.)"""
    self = optimizer()
    if self is not None and self.stash:
        if p in self.fp32_grads:
            self.fp32_grads[p].add_(p.grad)
        else:
            self.fp32_grads[p] = p.grad.float()
        p.grad = None


class MasterAdamW(torch.optim.Optimizer):
    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 compile: bool = False):
        super().__init__(list(params), dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.stash, self.grad_scale, self.fp32_grads = False, None, {}
        # dynamic: one graph for every size (a list of all tensors compiled as one took minutes on a 1.7B model)
        self.update = torch.compile(_adamw, dynamic=True) if compile else _adamw
        for p in self.params():
            master = p.detach().float().clone()
            p.data = p.data.to(_HALF)
            if p.requires_grad:
                self.state[p] = dict(step=torch.tensor(0.0), master=master, exp_avg=torch.zeros_like(master),
                                     exp_avg_sq=torch.zeros_like(master))
                p.register_post_accumulate_grad_hook(functools.partial(_accumulate, weakref.ref(self)))

    def params(self):
        return [p for g in self.param_groups for p in g["params"]]

    def grads(self) -> list[torch.Tensor]:
        return [self.fp32_grads.get(p, p.grad) for p in self.params() if p in self.fp32_grads or p.grad is not None]

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.fp32_grads = {}

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group in self.param_groups:
            b1, b2 = group["betas"]
            scalars = {}  # (step, device) -> the update's scalars, one host-to-device copy each
            for p in group["params"]:
                g = self.fp32_grads.get(p, p.grad)
                if g is None:
                    continue
                s = self.state[p]
                s["step"] += 1
                t = float(s["step"])
                if (t, p.device) not in scalars:
                    scalars[t, p.device] = (torch.tensor([group["lr"], b1, b2, group["eps"], group["weight_decay"],
                                                          1 - b1 ** t, 1 - b2 ** t], device=p.device),
                                            torch.ones((), device=p.device) if self.grad_scale is None else
                                            self.grad_scale.to(p.device))
                tensors = (p, g, s["master"], s["exp_avg"], s["exp_avg_sq"])
                if all(x.is_contiguous() for x in tensors):  # flat: one compiled kernel, whatever the shape
                    self.update(*(x.view(-1) for x in tensors), *scalars[t, p.device])
                else:
                    _adamw(*tensors, *scalars[t, p.device])
        self.grad_scale = None

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch's, but the moments stay fp32 (torch casts optimizer state to the parameter's dtype), and the
        masters are kept when the state has none (a checkpoint restores them as the model's weights, in place:
        molt/actor/state.py); the bf16 parameters are then the masters rounded."""
        masters = {p: s["master"] for p, s in self.state.items()}
        super().load_state_dict(state_dict)
        keys = [k for g in state_dict["param_groups"] for k in g["params"]]  # ids, or names (DCP), in param order
        param = dict(zip(keys, self.params()))
        for key, saved in state_dict["state"].items():
            for k in ("master", "exp_avg", "exp_avg_sq"):
                if k in saved:
                    self.state[param[key]][k] = saved[k].to(device=param[key].device, dtype=torch.float32)
        for p, master in masters.items():
            s = self.state[p]
            s.setdefault("master", master)
            with torch.no_grad():
                p.copy_(s["master"])
