"""The PyTorch tile backend: Θ's elementwise work on whole score rows, forward and backward, for the fused
node (all input rows at once) and for flash (a block of rows at a time; fused.py's normalize_by_tiles and
normalize_backward_by_tiles call these functions).

A tile is a = τ·X_R·K_Pᵀ for a set R of input rows, in the input dtype; row statistics ([R, 1]) and all
arithmetic are fp32; the tensors handed on to the next GEMM are in a's dtype. No function writes to its
arguments. tiles_triton.py implements the same functions as Triton kernels (one pass over the tile each) with
the same arguments and results.

With r = √N/√s (s: the row statistic over all N tokens), m the row max, q = N/s and c the backward's row
reduction (fused.py), `coef` being c·live/s or c·q/N respectively:
    l2_norm_gelu   forward  W = GeLU(r·a)
                   backward c = Σ D·(r·a) with D = GeLU'(r·a)·r·dW (l2_norm_gelu_backward_dot),
                            then W and dA = D − k·r·a with k = c·live/N (l2_norm_gelu_gradient)
    statistics     sum_squares: Σ a² (l2_norm_gelu's s); gelu_l2_norm_backward_dot: Σ r·dW·GeLU(a);
                   softmax_backward_dot: Σ q·dW·exp(a − m) (the backward's c of the other two)
    gelu_l2_norm   forward  G = GeLU(a), Σ G²
                   backward dA = GeLU'(a)·(r·dW − coef·G)             (and r·G, for dV)
    softmax        forward  E = exp(a − m), Σ E   (m at least a's own row max)
                   backward dA = E·(q·dW − coef), E = exp(a − m)      (and q·E, for dV)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.model.pattention.theta import at_least_fp32


def _gelu_slope(grad: Tensor, at: Tensor) -> Tensor:
    """GeLU'(at) ⊙ grad."""
    return torch.ops.aten.gelu_backward(grad, at)


def _row_dot(a: Tensor, b: Tensor) -> Tensor:
    """Σ a·b along each row, [R, 1]."""
    return torch.linalg.vecdot(a, b).unsqueeze(-1)


def sum_squares(a: Tensor) -> Tensor:
    a32 = at_least_fp32(a)
    return _row_dot(a32, a32)


def l2_norm_gelu_forward(a: Tensor, row: Tensor) -> Tensor:
    return F.gelu(at_least_fp32(a) * row).to(a.dtype)


def gelu_l2_norm_forward(a: Tensor) -> tuple[Tensor, Tensor]:
    g = F.gelu(at_least_fp32(a))
    return g.to(a.dtype), torch.linalg.vector_norm(g, dim=-1, keepdim=True).square_()


def softmax_forward(a: Tensor, row_max: Tensor) -> tuple[Tensor, Tensor]:
    e = torch.exp(at_least_fp32(a) - row_max)
    return e.to(a.dtype), e.sum(dim=-1, keepdim=True)


def gelu_l2_norm_backward(a: Tensor, grad_w: Tensor, row: Tensor, coef: Tensor) -> tuple[Tensor, Tensor]:
    a32 = at_least_fp32(a)
    g = F.gelu(a32)
    grad_a = _gelu_slope(at_least_fp32(grad_w) * row - coef * g, a32)
    return (g * row).to(a.dtype), grad_a.to(a.dtype)


def softmax_backward(a: Tensor, grad_w: Tensor, row_max: Tensor, q: Tensor, coef: Tensor) -> tuple[Tensor, Tensor]:
    e = torch.exp(at_least_fp32(a) - row_max)
    grad_a = (at_least_fp32(grad_w) * q - coef) * e
    return (e * q).to(a.dtype), grad_a.to(a.dtype)


def l2_norm_gelu_backward_dot(a: Tensor, grad_w: Tensor, row: Tensor) -> Tensor:
    z = at_least_fp32(a) * row
    return _row_dot(_gelu_slope(at_least_fp32(grad_w) * row, z), z)


def l2_norm_gelu_gradient(a: Tensor, grad_w: Tensor, row: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    z = at_least_fp32(a) * row
    grad_a = _gelu_slope(at_least_fp32(grad_w) * row, z) - k * z
    return F.gelu(z).to(a.dtype), grad_a.to(a.dtype)


def gelu_l2_norm_backward_dot(a: Tensor, grad_w: Tensor, row: Tensor) -> Tensor:
    return _row_dot(at_least_fp32(grad_w) * row, F.gelu(at_least_fp32(a)))


def softmax_backward_dot(a: Tensor, grad_w: Tensor, row_max: Tensor, q: Tensor) -> Tensor:
    return _row_dot(at_least_fp32(grad_w) * q, torch.exp(at_least_fp32(a) - row_max))
