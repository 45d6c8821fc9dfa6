"""Pattention, TokenFormer's replacement for Linear: attention from input tokens to learnable parameter tokens.

    theta.py     Θ and the row statistics every implementation shares
    plain.py     the reference formula under autograd            (pattention_impl: plain)
    fused.py     one autograd node keeping one score matrix      (pattention_impl: fused)
    flash.py     blocks of input rows, keeping no score matrix   (pattention_impl: flash)
    flash_triton.py   Triton kernels keeping no score tile in device memory  (flash; l2 Θ, flash_backend: kernels)
    tiles_torch.py, tiles_triton.py   Θ's tile backends           (flash_backend: pytorch, triton)
    registry.py  implementation and tile backend by name
    layer.py     `Pattention`, the nn.Module, usable on its own in any PyTorch code
    boundary.py  its sizes and inputs checked where user code meets it
    parallel.py  `ParallelPattention`, the layer split over the tensor-parallel ranks

Importing this package never imports Triton: tiles_triton and flash_triton are loaded when a Pattention runs with
a Triton backend.
"""

from megatron.model.args import NORM_ACTIVATIONS
from megatron.model.pattention.layer import Pattention
from megatron.model.pattention.parallel import ParallelPattention
from megatron.model.pattention.plain import pattention
from megatron.model.pattention.registry import pattentions_function
from megatron.model.pattention.theta import (
    ZERO_ROW_GUARD,
    local_row_max,
    local_row_sum,
    normalize_scores,
    parameter_token_scores,
)

__all__ = ["Pattention", "ParallelPattention", "pattention", "pattentions_function", "NORM_ACTIVATIONS",
           "ZERO_ROW_GUARD", "parameter_token_scores", "local_row_max", "local_row_sum", "normalize_scores"]
