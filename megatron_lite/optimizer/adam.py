"""AdamW whose moments may be stored in bf16 or fp16: Megatron's --use-precision-aware-optimizer with
--exp-avg-dtype / --exp-avg-sq-dtype.

Each step reads the stored moments up to fp32, applies torch.optim.AdamW's update (decoupled weight decay, the
same operations in the same order) to the fp32 main weights, and stores the moments back in their dtype, so
with fp32 moments it computes exactly what torch.optim.AdamW's single-tensor path computes. Storing both
moments in bf16 halves Adam's 8 bytes per parameter.
"""

from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class PrecisionAwareAdamW(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.dtypes = {"exp_avg": exp_avg_dtype, "exp_avg_sq": exp_avg_sq_dtype}

    def load_state_dict(self, state_dict: dict) -> None:
        """torch casts loaded state to each parameter's dtype (fp32 here): the moments go back to theirs."""
        super().load_state_dict(state_dict)
        for st in self.state.values():
            for kind, dtype in self.dtypes.items():
                if kind in st and st[kind].dtype != dtype:
                    st[kind] = st[kind].to(dtype)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("PrecisionAwareAdamW takes no closure")
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    for kind, dtype in self.dtypes.items():
                        st[kind] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
                st["step"] += 1
                m = st["exp_avg"] if st["exp_avg"].dtype == p.dtype else st["exp_avg"].to(p.dtype)
                v = st["exp_avg_sq"] if st["exp_avg_sq"].dtype == p.dtype else st["exp_avg_sq"].to(p.dtype)
                # torch.optim.AdamW's single-tensor update, operation for operation
                p.mul_(1 - lr * wd)
                m.lerp_(grad, 1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step = float(st["step"])
                step_size = lr / (1 - beta1**step)
                denom = (v.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
                p.addcdiv_(m, denom, value=-step_size)
                if m is not st["exp_avg"]:
                    st["exp_avg"].copy_(m)
                if v is not st["exp_avg_sq"]:
                    st["exp_avg_sq"].copy_(v)
