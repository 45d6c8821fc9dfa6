"""Training: distributed set-up, data iterators, the optimizer step and the run loop."""

from megatron.training.pretrain import pretrain

__all__ = ["pretrain"]
