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


SCHEDULE_KEYS = ("lr", "min_lr", "warmup", "lr_decay_iters", "lr_decay_style", "train_iters")


def resume_lr_change(saved, current, iteration: int, factor: float = 2.0) -> str | None:
    """A warning when the learning rate this run uses after resuming at `iteration` differs by more than `factor`
    from the one the checkpoint's own run (`saved`, its config) would have used, naming the schedule keys that
    cause it; None otherwise."""
    expected = LRSchedule.from_config(saved).lr_at(iteration)
    used = LRSchedule.from_config(current).lr_at(iteration)
    if used <= 0 or expected <= 0 or max(used / expected, expected / used) <= factor:
        return None
    changed = [f"{key} ({getattr(saved, key)!r} -> {getattr(current, key)!r})" for key in SCHEDULE_KEYS
               if getattr(saved, key) != getattr(current, key)]
    ratio = used / expected
    change = f"{ratio:.3g}x higher" if ratio > 1 else f"{1 / ratio:.3g}x lower"
    return (f"resuming at iteration {iteration} with learning rate {used:.3e}, {change} than the {expected:.3e} the "
            f"checkpoint's run would have used next: {', '.join(changed)} differ from its config.json. If that is "
            "not intended, set them as the checkpoint's run had them")
