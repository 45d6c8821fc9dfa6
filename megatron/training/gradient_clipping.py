"""The global gradient norm and clipping by it, as multi-tensor operations on the device.

DeepSpeed's ZeRO and bf16 optimizers compute the global gradient norm themselves: each tensor-parallel
block once, a replicated parameter once per pipeline stage (on its tensor rank 0), a weight tied across
stages once, summed over the model-parallel ranks. With stage 0 in fp32 the engine instead clips with
`clip_grad_norm_`, which reports no norm and, under pipeline parallelism, counts a replicated parameter
on the first stage only and a tied weight on every stage that holds it. There we switch DeepSpeed's
clipping off (`deepspeed_config`) and an optimizer pre-step hook computes the norm the way the ZeRO
optimizers do and clips with it, so every layout trains the same. The norm is left in the optimizer's
`_global_grad_norm`, the attribute DeepSpeed's engine reads after each step (`get_global_grad_norm()`).

The lean step (lean_step.py) uses the same two functions. Both stay on the device: the per-tensor norms
are one `_foreach_norm` (a few kernel launches on a GPU, whatever the parameter count), accumulated in
fp32, where DeepSpeed's ZeRO optimizer takes each norm of a float64 copy of the gradient; the clipping
factor is a device tensor, so nothing waits for the device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from deepspeed.runtime.constants import PIPE_REPLICATED

from megatron import mpu

def clips_in_optimizer(cfg) -> bool:
    """Whether DeepSpeed hands the gradients to our torch optimizer as they are."""
    return (cfg.zero_optimization or {}).get("stage", 0) == 0 and cfg.precision == "fp32"


def counted_in_norm(parameter: torch.Tensor) -> bool:
    """Whether this rank counts `parameter` in the global norm: not a pipeline stage's replica of a weight
    another stage owns, and on tensor rank 0 unless it is this rank's block of a split tensor."""
    if getattr(parameter, PIPE_REPLICATED, False):
        return False
    return mpu.get_tensor_parallel_rank() == 0 or mpu.is_split(parameter)


def _sum_over(total: torch.Tensor, group: dist.ProcessGroup) -> None:
    if dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)


def global_norm(gradients: list[torch.Tensor], device: torch.device,
                sharded_over: dist.ProcessGroup | None = None) -> torch.Tensor:
    """2-norm (fp32, on the device) of the model's gradient, given the tensors this rank counts
    (counted_in_norm) summed over data-parallel replicas and tied copies: one multi-tensor norm (on a GPU), the
    squares summed over the tensor- and pipeline-parallel ranks, and over `sharded_over` where each of its ranks
    holds a part of the gradient (ZeRO's partitions).

    A GPU's norm kernel sums each block of a tensor in a tree. torch's CPU kernel sums a whole tensor in one
    running fp32 sum per vector lane (relative error 1e-3 at 20M elements), so there each tensor's rows are normed
    (a parameter's rows are short; its 1-D tensors are small) and their squares summed by torch.sum's cascade."""
    if not gradients:
        squares = torch.zeros((), device=device)
    elif device.type == "cpu":
        rows = [torch.linalg.vector_norm(g.reshape(-1, g.shape[-1]) if g.dim() > 1 else g.reshape(1, -1), dim=-1)
                for g in gradients]
        squares = torch.cat(rows).square().sum()
    else:
        squares = torch.stack(torch._foreach_norm(gradients)).float().square().sum()
    _sum_over(squares, mpu.get_tensor_parallel_group())
    _sum_over(squares, mpu.get_pipe_parallel_group())
    if sharded_over is not None:
        _sum_over(squares, sharded_over)
    return squares.sqrt()


def clip_by_norm_(gradients: list[torch.Tensor], norm: torch.Tensor, max_norm: float, loss_scale: float = 1.0) -> None:
    """Scale `gradients` in place by 1 / max(1, (norm + 1e-6) / max_norm), DeepSpeed's ZeRO clipping rule in
    its order of operations; nothing with max_norm 0. With fp16's `loss_scale` (`norm` is then the scaled
    gradients' norm) the gradients are unscaled in the same multiplication, as DeepSpeed's `unscale_and_clip_grads`."""
    if not gradients or (max_norm <= 0 and loss_scale == 1.0):
        return
    if max_norm <= 0:
        torch._foreach_mul_(gradients, 1.0 / loss_scale)
    elif loss_scale == 1.0:
        torch._foreach_mul_(gradients, 1.0 / torch.clamp((norm + 1e-6) / max_norm, min=1.0))
    else:
        torch._foreach_mul_(gradients, 1.0 / (torch.clamp((norm / loss_scale + 1e-6) / max_norm, min=1.0) * loss_scale))


def install_gradient_clipping(optimizer: torch.optim.Optimizer, max_norm: float) -> None:
    """Before every step of `optimizer`: the global norm, then (max_norm > 0) clip_by_norm_."""

    def clip(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        counted = [p.grad for group in optimizer.param_groups for p in group["params"]
                   if p.grad is not None and counted_in_norm(p)]
        norm = global_norm(counted, optimizer.param_groups[0]["params"][0].device)
        optimizer._global_grad_norm = norm
        clip_by_norm_(grads, norm, max_norm)

    optimizer.register_step_pre_hook(clip)
