"""The plain Pattention: theta.py's formula differentiated by autograd, the reference the others are tested
against (`pattention_impl: plain`). It keeps about three score-sized [tokens, n] tensors for backward."""

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from megatron.model.pattention.theta import (
    Reduce,
    identity,
    local_row_max,
    local_row_sum,
    normalize_scores,
    parameter_token_scores,
)


def pattention(
    x: Tensor,
    key_tokens: Tensor,
    value_tokens: Tensor,
    theta: str,
    tau: float,
    norm_token_count: int | Tensor,
    combine_row_max: Callable[[Tensor], Tensor] = identity,
    combine_row_sum: Callable[[Tensor], Tensor] = identity,
) -> Tensor:
    """Θ(τ · x · key_tokensᵀ) · value_tokens for x [..., d_in] -> [..., d_out].

    When key/value_tokens are one block of the layer's tokens, `combine_row_max` / `combine_row_sum`
    turn this block's row statistics into the whole layer's (all-reduces MAX / SUM over the blocks) and
    the result is this block's share of the output; by default the tokens are the whole layer.
    """
    scores = parameter_token_scores(x, key_tokens, tau)
    row_max = local_row_max(scores, theta)
    if row_max is not None:
        row_max = combine_row_max(row_max)
    row_sum = combine_row_sum(local_row_sum(scores, theta, row_max))
    weights = normalize_scores(scores, theta, row_sum, row_max, norm_token_count)
    return torch.matmul(weights.to(scores.dtype), value_tokens)


class _Combined(torch.autograd.Function):
    """reduce(statistic) whose gradient is reduce(gradient): a row statistic summed over the ranks that hold
    the other token blocks and used by all of them, as autograd must see it for the plain formula."""

    @staticmethod
    def forward(ctx, statistic, reduce):
        ctx.reduce = reduce
        return reduce(statistic)

    @staticmethod
    def backward(ctx, grad):
        return ctx.reduce(grad.contiguous()), None


def plain_pattentions(
    x: Tensor,
    key_tokens: Sequence[Tensor],
    value_tokens: Sequence[Tensor],
    theta: str,
    tau: float,
    norm_token_counts: Sequence[int | Tensor],
    reduce_sum: Reduce = identity,
    reduce_max: Reduce = identity,
) -> Tensor:
    """Several Pattentions of x by the reference formula ([B, ..., d_out]), with the registry's contract:
    `reduce_sum` / `reduce_max` are plain (non-autograd) reductions, wrapped here for autograd."""
    def combine_sum(statistic: Tensor) -> Tensor:
        return statistic if reduce_sum is identity else _Combined.apply(statistic, reduce_sum)

    return torch.stack([pattention(x, k, v, theta, tau, n, reduce_max, combine_sum)
                        for k, v, n in zip(key_tokens, value_tokens, norm_token_counts)])
