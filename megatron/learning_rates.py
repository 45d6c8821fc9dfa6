"""Learning-rate schedule: linear warmup, then decay to `min_lr` (GPT-NeoX semantics).

The rate is a pure function of the iteration, so resuming from a checkpoint
needs only the iteration number to continue the schedule exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LRSchedule:
    max_lr: float
    min_lr: float
    warmup_iters: int
    decay_iters: int
    style: str  # "constant" | "linear" | "cosine"

    @classmethod
    def from_config(cls, cfg) -> "LRSchedule":
        decay_iters = cfg.lr_decay_iters or cfg.train_iters
        return cls(
            max_lr=cfg.lr,
            min_lr=cfg.min_lr,
            # GPT-NeoX: `warmup` is a fraction of the decay length.
            warmup_iters=int(cfg.warmup * decay_iters),
            decay_iters=decay_iters,
            style=cfg.lr_decay_style,
        )

    def lr_at(self, iteration: int) -> float:
        """Learning rate used for the update that produces `iteration` + 1."""
        if self.warmup_iters > 0 and iteration < self.warmup_iters:
            return self.max_lr * (iteration + 1) / self.warmup_iters
        if self.style == "constant":
            return self.max_lr
        progress = min(iteration - self.warmup_iters, self.decay_iters - self.warmup_iters)
        span = max(self.decay_iters - self.warmup_iters, 1)
        if self.style == "linear":
            fraction = 1.0 - progress / span
        elif self.style == "cosine":
            fraction = 0.5 * (math.cos(math.pi * progress / span) + 1.0)
        else:
            raise ValueError(f"lr_decay_style {self.style!r}: expected constant, linear or cosine")
        return self.min_lr + (self.max_lr - self.min_lr) * fraction

    def apply(self, optimizer: torch.optim.Optimizer, iteration: int) -> float:
        lr = self.lr_at(iteration)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr
