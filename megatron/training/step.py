"""One optimizer step and one evaluation pass over a DeepSpeed engine."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron import mpu


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32 whatever the model's dtype."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def _forward(engine, batch: torch.Tensor) -> torch.Tensor:
    batch = batch.to(engine.device)
    return lm_loss(engine(batch[:, :-1]), batch[:, 1:])


def data_parallel_mean(value: torch.Tensor) -> float:
    value = value.detach().float().clone()
    dist.all_reduce(value, group=mpu.get_data_parallel_group())
    return value.item() / mpu.get_data_parallel_world_size()


def _replicated_grad_norm(engine) -> float:
    """Global gradient norm when gradients are whole on every rank (ZeRO stage 0).

    DeepSpeed reports the norm itself for ZeRO 1/2 (where gradients are
    partitioned) but not for stage 0, so we compute it there, after the
    data-parallel all-reduce of the accumulation boundary and before the step.
    """
    squares = [p.grad.detach().float().pow(2).sum() for p in engine.module.parameters() if p.grad is not None]
    return torch.stack(squares).sum().sqrt().item()


def train_step(engine, batches: Iterator[torch.Tensor]) -> tuple[float, float | None]:
    """Forward/backward over every micro-batch of one global batch, then the update.

    DeepSpeed's engine scales each micro-batch loss by 1/accumulation steps and
    steps the optimizer at the accumulation boundary. Returns the mean loss
    over the global batch (all data-parallel ranks) and the gradient norm.
    """
    engine.train()
    total = torch.zeros((), device=engine.device)
    steps = engine.gradient_accumulation_steps()
    grad_norm = None
    for _ in range(steps):
        loss = _forward(engine, next(batches))
        engine.backward(loss)
        if engine.is_gradient_accumulation_boundary() and engine.zero_optimization_stage() == 0:
            grad_norm = _replicated_grad_norm(engine)
        engine.step()
        total += loss.detach()
    if grad_norm is None and engine.get_global_grad_norm() is not None:
        grad_norm = float(engine.get_global_grad_norm())
    return data_parallel_mean(total / steps), grad_norm


@torch.no_grad()
def evaluate(engine, batches: Iterator[torch.Tensor], num_global_batches: int) -> float:
    """Mean loss over the first `num_global_batches` global batches of a split."""
    engine.eval()
    total = torch.zeros((), device=engine.device)
    count = num_global_batches * engine.gradient_accumulation_steps()
    for _ in range(count):
        total += _forward(engine, next(batches))
    engine.train()
    return data_parallel_mean(total / count)
