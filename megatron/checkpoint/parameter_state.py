"""The unit growth and re-sharding work in: one parameter's training state, as whole tensors.

A checkpoint of any layout (tensor ranks, pipeline stages, ZeRO partitions over data-parallel ranks,
fp32 or bf16 with fp32 master weights) is read as `ParameterState`s under TokenFormerModel's names;
growth maps each one to its larger self; a writer cuts them into the target layout. Going through whole
parameters one at a time keeps memory near the largest parameter, not the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from torch import Tensor


@dataclass(frozen=True)
class ParameterState:
    """One parameter (or a block of it), fp32.

    `weight` is the value training continues from: the fp32 master copy where the run kept one (bf16,
    fp16), else the module's own weight. `exp_avg` / `exp_avg_sq` are Adam's moments, None when the
    checkpoint holds no optimizer state for it (weights-only checkpoints, frozen parameters, buffers).
    """

    weight: Tensor
    exp_avg: Tensor | None = None
    exp_avg_sq: Tensor | None = None

    @property
    def has_moments(self) -> bool:
        return self.exp_avg is not None and self.exp_avg_sq is not None

    def without_moments(self) -> ParameterState:
        return replace(self, exp_avg=None, exp_avg_sq=None)

    def tensors(self) -> list[Tensor]:
        """The weight and whichever moments are present."""
        return [t for t in (self.weight, self.exp_avg, self.exp_avg_sq) if t is not None]

    def map(self, function: Callable[[Tensor], Tensor]) -> ParameterState:
        """`function` applied to the weight and to each moment present (e.g. taking one block of each)."""
        return ParameterState(*(None if tensor is None else function(tensor)
                                for tensor in (self.weight, self.exp_avg, self.exp_avg_sq)))


def as_fp32(saved: Tensor) -> Tensor:
    """A floating-point tensor in fp32 (itself, not a copy, if it is), anything else (an integer buffer) as is."""
    return saved.float() if saved.is_floating_point() else saved
