"""One optimizer step and one evaluation pass over a DeepSpeed engine."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.engine import PipelineEngine

from megatron import mpu
from megatron.training.phases import BACKWARD, DATA, FORWARD, LOSS, LOSS_READOUT, OPTIMIZER, phase


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of the vocabulary-split logits, in fp32 whatever the model's dtype."""
    with phase(LOSS):
        return mpu.vocab_parallel_cross_entropy(logits, labels).mean()


def _forward(engine, batches: Iterator[torch.Tensor]) -> torch.Tensor:
    with phase(DATA):
        batch = next(batches).to(engine.device)
    with phase(FORWARD):
        logits = engine(batch[:, :-1])
    return lm_loss(logits, batch[:, 1:])


def data_parallel_mean(value: torch.Tensor) -> float:
    with phase(LOSS_READOUT):
        value = value.detach().float().clone()
        dist.all_reduce(value, group=mpu.get_data_parallel_group())
        return value.item() / mpu.get_data_parallel_world_size()


def _pipeline_micro_batches(batches: Iterator[torch.Tensor]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, labels) pairs, as DeepSpeed's pipeline engine reads them: the first stage takes the inputs,
    the last the labels; it pulls one pair per micro-batch of the step."""
    return ((batch[:, :-1], batch[:, 1:]) for batch in batches)


def _accumulate(engine, batches: Iterator[torch.Tensor]) -> float:
    """Forward/backward over every micro-batch of one global batch, then the update (the plain engine
    scales each micro-batch loss by 1/accumulation steps and steps the optimizer at the boundary)."""
    engine.train()
    total = torch.zeros((), device=engine.device)
    steps = engine.gradient_accumulation_steps()
    for _ in range(steps):
        loss = _forward(engine, batches)
        with phase(BACKWARD):
            engine.backward(loss)
        with phase(OPTIMIZER):
            engine.step()
        total += loss.detach()
    return data_parallel_mean(total / steps)


def train_step(engine, batches: Iterator[torch.Tensor]) -> tuple[float, float | None]:
    """One optimizer step on the next global batch: the mean loss over it (all data-parallel ranks) and
    the global gradient norm, the same quantities whether or not the model is pipelined."""
    if isinstance(engine, PipelineEngine):
        loss = engine.train_batch(_pipeline_micro_batches(batches))
        with phase(LOSS_READOUT):
            loss = float(loss)
    else:
        loss = _accumulate(engine, batches)
    with phase(LOSS_READOUT):
        grad_norm = engine.get_global_grad_norm()
        return loss, None if grad_norm is None else float(grad_norm)


@torch.no_grad()
def evaluate(engine, batches: Iterator[torch.Tensor], num_global_batches: int) -> float:
    """Mean loss over the first `num_global_batches` global batches of a split."""
    if isinstance(engine, PipelineEngine):
        losses = [float(engine.eval_batch(_pipeline_micro_batches(batches))) for _ in range(num_global_batches)]
        return sum(losses) / num_global_batches
    engine.eval()
    total = torch.zeros((), device=engine.device)
    count = num_global_batches * engine.gradient_accumulation_steps()
    for _ in range(count):
        total += _forward(engine, batches)
    engine.train()
    return data_parallel_mean(total / count)
