"""Pattention split over the tensor-parallel ranks along its parameter-token axis.

Rank r of t holds key and value tokens [r·n/t, (r+1)·n/t) of the layer, under the single-device names
(`key_param_tokens`, `value_param_tokens`), and the global n in `norm_token_count`. For a full input X:

    A_r = τ·X·K_rᵀ                                          local scores [tokens, n/t]
    s = Σ_r rowsum_r(A_r)   (softmax: after m = max_r rowmax)  one all-reduce of [tokens]
    Y_r = Θ(A_r; s, m, n)·V_r                                this rank's share; Σ_r Y_r = Pattention(X)

The shares are summed by the caller: an all-reduce when the next computation is replicated (`forward`),
a reduce-scatter when it is split (Q, K, V into attention heads). The math is the layer's (layer.py), given
the tensor-parallel all-reduces for the row statistics (forward) and their gradient (backward).
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from megatron.model.args import DEFAULT_GROWTH_MODE
from megatron.model.pattention.layer import DEFAULT_IMPL, Pattention
from megatron.mpu import all_reduce_max, all_reduce_sum, copy_to_region, mark_split, reduce_from_region, split_size


class ParallelPattention(Pattention):
    """A Pattention d_in -> d_out of `n` tokens, of which this rank holds its contiguous block."""

    def __init__(
        self,
        d_in: int,
        d_out: int,
        n: int,
        theta: str = "l2_norm_gelu",
        tau: float = 1.0,
        *,
        impl: str = DEFAULT_IMPL,
        flash_backend: str = "auto",
        device: str | torch.device | None = None,
    ) -> None:
        local_tokens = split_size(n, "a Pattention's parameter-token count (slot_num)")
        super().__init__(d_in, d_out, local_tokens, theta, tau, impl=impl, flash_backend=flash_backend, device=device,
                         norm_token_count=n)
        mark_split(self.key_param_tokens, dim=0)
        mark_split(self.value_param_tokens, dim=0)

    def grow(self, new_count: int, mode: str = DEFAULT_GROWTH_MODE) -> None:
        """Refused: a block's new rows belong between the other ranks' blocks, drawn from the model's init."""
        raise NotImplementedError("ParallelPattention is one tensor-parallel block of a model's Pattention: grow the "
                                  "model's checkpoint (tools/grow_checkpoint.py) or the running job (growth_schedule; "
                                  "docs/growth.md), which place the new tokens of every block and draw them from the "
                                  "config's init")

    def partial_output(self, x: Tensor) -> Tensor:
        """This rank's share Θ(A_r)·V_r of the output for input x, which every rank must hold in full."""
        return self.run_split([self], x).squeeze(0)

    def run_split(self, layers: Sequence["ParallelPattention"], x: Tensor) -> Tensor:
        """This rank's shares of `layers` (this one's settings) on the same input x: [len(layers), ..., d_out]."""
        return self.run(layers, x, reduce_sum=all_reduce_sum, reduce_max=all_reduce_max)

    def forward(self, x: Tensor) -> Tensor:
        """Replicated x [..., d_in] -> replicated output [..., d_out]."""
        return reduce_from_region(self.partial_output(copy_to_region(x)))
