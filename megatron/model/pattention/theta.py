"""Θ, the normalisation of Pattention's scores, and the row statistics every implementation shares.

    Pattention(X, K_P, V_P) = Θ(τ · X · K_Pᵀ) · V_P,   K_P: [n, d_in],  V_P: [n, d_out]

Θ normalises each row of scores A (length n, one entry per parameter token):
    l2_norm_gelu:  GeLU(A / ‖A‖₂ · √n)
    gelu_l2_norm:  G / ‖G‖₂ · √n  with G = GeLU(A)
    softmax:       exp(A) / ‖exp(A)‖₁ · n   (= softmax(A) · n, computed with the row max subtracted)

n is the layer's `norm_token_count` buffer, fixed when the layer is created: growing the layer by appending
parameter tokens whose keys are zero adds zero scores, which leaves ‖A‖₂ and GeLU-weights unchanged, so
both l2 variants compute the same function after growth (softmax does not: exp(0) = 1 adds mass).

The math is split so that tensor parallelism, which shards the n parameter tokens across ranks, can wrap
it without copying it:
    scores = parameter_token_scores(x, K_local, tau)
    row_max = local_row_max(scores, theta)            # softmax only; all-reduce MAX
    row_sum = local_row_sum(scores, theta, row_max)   # all-reduce SUM
    out = normalize_scores(scores, theta, row_sum, row_max, n) @ V_local   # all-reduce SUM
plain.py composes these under autograd (the reference); fused.py and flash.py compute the same values in
their own autograd nodes. Statistics and Θ are computed in at least fp32 (bf16/fp16 scores are upcast).
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.model.args import NORM_ACTIVATIONS

# Floor on the squared L2 norm of a score row: an all-zero row (e.g. a zero input) then gives zero
# weights instead of 0/0 = NaN. Real rows have squared norms many orders of magnitude above it.
ZERO_ROW_GUARD = 1e-12

# Combines a row statistic of this rank's parameter tokens into the whole layer's (a tensor-parallel
# all-reduce); `identity` when one process holds the whole layer.
Reduce = Callable[[Tensor], Tensor]


def identity(statistic: Tensor) -> Tensor:
    """The `Reduce` of a layer held whole by one process."""
    return statistic


def at_least_fp32(scores: Tensor) -> Tensor:
    """bf16/fp16 scores upcast to fp32 for the statistics; fp32/fp64 kept as they are."""
    return scores.to(torch.promote_types(scores.dtype, torch.float32))


def check_theta(theta: str) -> None:
    """Refuse a Θ name that is not one of NORM_ACTIVATIONS (the config key is norm_activation_type)."""
    if theta not in NORM_ACTIVATIONS:
        raise ValueError(f"norm_activation_type={theta!r} (Pattention's theta): must be one of "
                         f"{', '.join(NORM_ACTIVATIONS)}")


def parameter_token_scores(x: Tensor, key_tokens: Tensor, tau: float) -> Tensor:
    """τ · X · K_Pᵀ: one score per (input token, parameter token), in the input dtype."""
    return F.linear(x, key_tokens) * tau


def local_row_max(scores: Tensor, theta: str) -> Tensor | None:
    """Row max of the scores (at least fp32, detached) for a stable softmax; None for the l2 variants.

    Detaching is exact: softmax does not depend on the shift, so no gradient flows through it.
    """
    check_theta(theta)
    if theta != "softmax":
        return None
    return at_least_fp32(scores.detach()).amax(dim=-1, keepdim=True)


def local_row_sum(scores: Tensor, theta: str, row_max: Tensor | None) -> Tensor:
    """The per-row sum Θ divides by, at least fp32, [..., 1]: Σa², ΣGeLU(a)², or Σexp(a − row_max).

    Sums over disjoint blocks of parameter tokens add up to the sum over all tokens.
    """
    check_theta(theta)
    a = at_least_fp32(scores)
    if theta == "l2_norm_gelu":
        return a.square().sum(dim=-1, keepdim=True)
    if theta == "gelu_l2_norm":
        return F.gelu(a).square().sum(dim=-1, keepdim=True)
    return torch.exp(a - row_max).sum(dim=-1, keepdim=True)


def normalize_scores(
    scores: Tensor,
    theta: str,
    row_sum: Tensor,
    row_max: Tensor | None,
    norm_token_count: int | Tensor,
) -> Tensor:
    """Θ applied to the scores, given row statistics over all parameter tokens; weights in at least fp32."""
    check_theta(theta)
    a = at_least_fp32(scores)
    n = torch.as_tensor(norm_token_count, dtype=a.dtype, device=a.device)
    if theta == "softmax":
        return torch.exp(a - row_max) / row_sum * n
    inverse_norm = torch.rsqrt(row_sum.clamp_min(ZERO_ROW_GUARD)) * n.sqrt()
    if theta == "l2_norm_gelu":
        return F.gelu(a * inverse_norm)
    return F.gelu(a) * inverse_norm


def row_dot(a: Tensor, b: Tensor) -> Tensor:
    """Σ a·b along the last dim in at least fp32, [..., 1], in at most 16 blocks of rows (of at least 2¹⁶
    elements): the elementwise product (and a bf16/fp16 input's upcast) never takes a whole [rows, ·] buffer,
    which would raise the peak memory. The backward passes' row reduction c (fused.py, flash.py)."""
    out = torch.empty(*a.shape[:-1], 1, dtype=torch.promote_types(a.dtype, torch.float32), device=a.device)
    rows = max(-(-a.shape[-2] // 16), 2**16 // a.shape[-1], 1)
    for a_rows, b_rows, out_rows in zip(a.split(rows, -2), b.split(rows, -2), out.split(rows, -2)):
        torch.linalg.vecdot(at_least_fp32(a_rows), at_least_fp32(b_rows), out=out_rows.squeeze(-1))
    return out
