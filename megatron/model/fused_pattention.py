"""Memory-efficient Pattention: one autograd node with a hand-written backward.

Autograd through the plain formula (pattention.py) keeps three score-sized
tensors per layer alive for backward (the scores A, the normalised scores and
the GeLU output, [tokens, n] each) and runs a dozen element-wise passes in
backward. Here forward saves only A and one statistic per row; backward
recomputes the element-wise chain from A and applies the closed-form gradient
of the normalisation. Values and gradients equal the plain formula's (tests).

Backward, per row, with s the row statistic over all N parameter tokens and
c a row reduction of the incoming gradient (also over all tokens):

    l2_norm_gelu:  Z = A·r, r = √N/√s, s = ΣA²      dZ = dS ⊙ GeLU'(Z)
                   dA = r·dZ − (r·c/s)·A,            c = Σ dZ·A
    gelu_l2_norm:  S = G·r, G = GeLU(A), s = ΣG²
                   dG = r·dS − (r·c/s)·G,            c = Σ dS·G,   dA = dG ⊙ GeLU'(A)
    softmax:       S = N·exp(A − m)/s, s = Σexp(A − m)
                   dA = S ⊙ (dS − c/N),              c = Σ dS·S

For tensor parallelism (each rank holding a block of the N tokens) the row
statistics and c are summed over ranks by the `reduce_sum` / `reduce_max`
callables; the output is this block's partial sum, as with the plain formula.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.model.pattention import ZERO_ROW_GUARD, _at_least_fp32, _check_norm_type

Reduce = Callable[[Tensor], Tensor]


def _local(statistic: Tensor) -> Tensor:
    return statistic


def _gelu_grad(grad: Tensor, at: Tensor) -> Tensor:
    return torch.ops.aten.gelu_backward(grad, at)


class _FusedPattention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, key_tokens, value_tokens, norm_type, tau, n, reduce_sum, reduce_max):
        scores = F.linear(x, key_tokens) * tau if tau != 1.0 else F.linear(x, key_tokens)
        a = _at_least_fp32(scores)
        if norm_type == "softmax":
            row_max = reduce_max(a.amax(dim=-1, keepdim=True))
            weights = torch.exp(a - row_max)
            statistic = reduce_sum(weights.sum(dim=-1, keepdim=True))
            weights.mul_(n / statistic)
        else:
            row_max = None
            g = F.gelu(a) if norm_type == "gelu_l2_norm" else a
            statistic = reduce_sum(torch.linalg.vector_norm(g, dim=-1, keepdim=True).square_())
            scale = torch.rsqrt(statistic.clamp(min=ZERO_ROW_GUARD)).mul_(n**0.5)
            weights = F.gelu(a * scale) if norm_type == "l2_norm_gelu" else g.mul_(scale)
        ctx.save_for_backward(x, key_tokens, value_tokens, scores, statistic, row_max)
        ctx.norm_type, ctx.tau, ctx.n, ctx.reduce_sum = norm_type, tau, n, reduce_sum
        return torch.matmul(weights.to(scores.dtype), value_tokens)

    @staticmethod
    def backward(ctx, grad_out):
        x, key_tokens, value_tokens, scores, statistic, row_max = ctx.saved_tensors
        norm_type, n, reduce_sum = ctx.norm_type, ctx.n, ctx.reduce_sum
        a = _at_least_fp32(scores)
        grad_weights = torch.matmul(grad_out, value_tokens.t()).to(a.dtype)
        if norm_type == "softmax":
            weights = torch.exp(a - row_max).mul_(n / statistic)
            c = reduce_sum(torch.linalg.vecdot(grad_weights, weights).unsqueeze(-1))
            grad_scores = grad_weights.sub_(c / n).mul_(weights)
        else:
            clamped = statistic.clamp(min=ZERO_ROW_GUARD)
            scale = torch.rsqrt(clamped).mul_(n**0.5)
            # Below the zero-row guard the scale is a constant: no gradient through the statistic.
            live = (statistic > ZERO_ROW_GUARD).to(a.dtype)
            if norm_type == "l2_norm_gelu":
                z = a * scale
                weights = F.gelu(z)
                grad_z = _gelu_grad(grad_weights, z)
                c = reduce_sum(torch.linalg.vecdot(grad_z, a).unsqueeze(-1))
                grad_scores = torch.addcmul(grad_z * scale, a, scale * c / clamped * live, value=-1)
            else:
                g = F.gelu(a)
                weights = g * scale
                c = reduce_sum(torch.linalg.vecdot(grad_weights, g).unsqueeze(-1))
                grad_g = torch.addcmul(grad_weights * scale, g, scale * c / clamped * live, value=-1)
                grad_scores = _gelu_grad(grad_g, a)
        grad_scores = grad_scores.to(scores.dtype)
        if ctx.tau != 1.0:
            grad_scores = grad_scores * ctx.tau
        flat_x = x.reshape(-1, x.shape[-1])
        flat_grad_scores = grad_scores.reshape(-1, grad_scores.shape[-1])
        grad_x = torch.matmul(grad_scores, key_tokens)
        grad_key = torch.matmul(flat_grad_scores.t(), flat_x)
        grad_value = torch.matmul(weights.to(scores.dtype).reshape(-1, weights.shape[-1]).t(),
                                  grad_out.reshape(-1, grad_out.shape[-1]))
        return grad_x, grad_key, grad_value, None, None, None, None, None


def fused_pattention(
    x: Tensor,
    key_tokens: Tensor,
    value_tokens: Tensor,
    norm_type: str,
    tau: float,
    norm_token_count: int | Tensor,
    reduce_sum: Reduce = _local,
    reduce_max: Reduce = _local,
) -> Tensor:
    """Same contract as `pattention.pattention`, computed by the memory-efficient autograd node.

    `reduce_sum` / `reduce_max` combine per-row statistics across the ranks that hold the other
    blocks of parameter tokens (plain, non-autograd all-reduces); identity for a whole layer.
    """
    _check_norm_type(norm_type)
    return _FusedPattention.apply(x, key_tokens, value_tokens, norm_type, float(tau), int(norm_token_count),
                                  reduce_sum, reduce_max)
