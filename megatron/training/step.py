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


def train_step(engine, batches: Iterator[torch.Tensor]) -> float:
    """Forward/backward over every micro-batch of one global batch, then the update.

    DeepSpeed's engine scales each micro-batch loss by 1/accumulation steps and
    steps the optimizer at the accumulation boundary. Returns the mean loss
    over the global batch (all data-parallel ranks).
    """
    engine.train()
    total = torch.zeros((), device=engine.device)
    steps = engine.gradient_accumulation_steps()
    for _ in range(steps):
        loss = _forward(engine, next(batches))
        engine.backward(loss)
        engine.step()
        total += loss.detach()
    return data_parallel_mean(total / steps)


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
