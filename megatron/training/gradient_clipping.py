"""Gradient norm and clipping when DeepSpeed steps our torch optimizer unwrapped (ZeRO stage 0, fp32).

DeepSpeed's ZeRO and bf16 optimizers compute the global gradient norm themselves: each tensor-parallel
block once, a replicated parameter once per pipeline stage (on its tensor rank 0), a weight tied across
stages once, summed over the model-parallel ranks. With stage 0 in fp32 the engine instead clips with
`clip_grad_norm_`, which reports no norm and, under pipeline parallelism, counts a replicated parameter
on the first stage only and a tied weight on every stage that holds it. There we switch DeepSpeed's
clipping off (`deepspeed_config`) and this optimizer pre-step hook computes the norm the way the ZeRO
optimizers do and clips with it, so every layout trains the same. The norm is left in the optimizer's
`_global_grad_norm`, the attribute DeepSpeed's engine reads after each step (`get_global_grad_norm()`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from deepspeed.runtime.constants import PIPE_REPLICATED

from megatron import mpu


def clips_in_optimizer(cfg) -> bool:
    """Whether DeepSpeed hands the gradients to our torch optimizer as they are."""
    return (cfg.zero_optimization or {}).get("stage", 0) == 0 and cfg.precision == "fp32"


def global_gradient_norm(parameters: list[torch.Tensor]) -> float:
    """2-norm of the gradients of the whole model (all stages, all tensor-parallel blocks); the gradients
    must already be summed over data-parallel replicas and tied copies."""
    counted_here = mpu.get_tensor_parallel_rank() == 0
    squares = [p.grad.detach().float().pow(2).sum() for p in parameters
               if p.grad is not None and not getattr(p, PIPE_REPLICATED, False)
               and (counted_here or mpu.is_split(p))]
    total = torch.stack(squares).sum() if squares else torch.zeros((), device=parameters[0].device)
    dist.all_reduce(total, group=mpu.get_tensor_parallel_group())
    dist.all_reduce(total, group=mpu.get_pipe_parallel_group())
    return total.sqrt().item()


def install_gradient_clipping(optimizer: torch.optim.Optimizer, max_norm: float) -> None:
    """Before every step of `optimizer`: the global norm, then (max_norm > 0) scale the gradients by
    min(1, max_norm / (norm + 1e-6)), DeepSpeed's clipping rule."""

    def clip(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        norm = global_gradient_norm(parameters)
        optimizer._global_grad_norm = norm
        coefficient = max_norm / (norm + 1e-6)
        if max_norm > 0 and coefficient < 1:
            for parameter in parameters:
                if parameter.grad is not None:
                    parameter.grad.mul_(coefficient)

    optimizer.register_step_pre_hook(clip)
