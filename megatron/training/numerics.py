"""Steps with a non-finite loss or gradient norm: never applied, counted, and the run stops after too many in a row.

DeepSpeed's ZeRO, bf16 and fp16 optimizers check the global gradient norm
before updating and skip the step when it is not finite (with fp16 that is how
the loss scaler finds its scale). With ZeRO stage 0 in fp32, DeepSpeed steps our
torch optimizer as it is, so `skip_nonfinite_updates` drops the gradients
before it runs: AdamW then leaves the weights, its moments and its step count
untouched. A non-finite loss makes the gradients non-finite, so every layout
skips such a step before the update.

After each step the ranks all-reduce whether it was bad, so all of them count
it (the lean step's ranks read the same loss and norm, and agree without it).
After `max_skipped_steps` bad steps in a row the run stops with an error; the
checkpoints already written are untouched. fp16 runs leave the stop to
DeepSpeed's loss scaler, which raises once the scale reaches its minimum.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron.runtime.agreed_error import AgreedError


class NonFiniteTrainingError(AgreedError):
    """Too many consecutive steps had a non-finite loss or gradient norm (every rank counts the same steps)."""


def skip_nonfinite_updates(optimizer: torch.optim.Optimizer) -> None:
    """Register after `install_gradient_clipping`, which leaves the global norm in `_global_grad_norm`.
    `overflow` is the attribute DeepSpeed's engine reads to count a skipped step (`was_step_applied`)."""

    def skip(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        optimizer.overflow = not math.isfinite(optimizer._global_grad_norm)
        if optimizer.overflow:
            optimizer.zero_grad(set_to_none=True)

    optimizer.register_step_pre_hook(skip)


class NonFiniteSteps:
    """Counts bad steps and applies the max_skipped_steps rule."""

    def __init__(self, engine, cfg, agreed: bool = False) -> None:
        """`agreed`: every rank reads the same loss and norm (one data-parallel rank and one pipeline stage: the
        tensor-parallel ranks' are replicated), so each decides alone, without a collective."""
        self._engine = engine
        self._limit = None if cfg.precision == "fp16" else cfg.max_skipped_steps
        self._agreed = agreed
        self.in_a_row = 0
        self.total = 0

    def check(self, iteration: int, loss: float, grad_norm: float | None) -> None:
        """After the step of `iteration` (collective unless `agreed`); raises NonFiniteTrainingError when the
        limit is reached."""
        finite = math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))
        bad = not (finite and self._engine.was_step_applied())
        if not self._agreed:
            flag = torch.tensor(float(bad), device=self._engine.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            bad = bool(flag.item())
        if not bad:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.total += 1
        if dist.get_rank() == 0:
            print(f"iteration {iteration}: loss {loss}, gradient norm {grad_norm}: update skipped "
                  f"({self.in_a_row} in a row, {self.total} in total)", flush=True)
        if self._limit is not None and self.in_a_row >= self._limit:
            raise NonFiniteTrainingError(
                f"stopping at iteration {iteration}: {self.in_a_row} steps in a row had a non-finite loss or "
                f"gradient norm (max_skipped_steps={self._limit}); none of them changed the weights, and the "
                "checkpoints already saved are intact. Resume from the last one with a lower learning rate, "
                "or look at the data these iterations read.")
