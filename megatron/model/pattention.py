"""Pattention: attention from input tokens to learnable parameter tokens (TokenFormer's replacement for Linear).

    Pattention(X, K_P, V_P) = Θ(τ · X · K_Pᵀ) · V_P,   K_P: [n, d_in],  V_P: [n, d_out]

Θ normalises each row of scores A (length n, one entry per parameter token):
    l2_norm_gelu:  GeLU(A / ‖A‖₂ · √n)
    gelu_l2_norm:  G / ‖G‖₂ · √n  with G = GeLU(A)
    softmax:       exp(A) / ‖exp(A)‖₁ · n   (= softmax(A) · n, computed with the row max subtracted)

n is the `norm_token_count` buffer, fixed when the layer is created: growing the layer by appending
parameter tokens whose keys are zero adds zero scores, which leaves ‖A‖₂ and GeLU-weights unchanged, so
both l2 variants compute the same function after growth (softmax does not: exp(0) = 1 adds mass).

The math is split so that tensor parallelism, which shards the n parameter tokens across ranks, can wrap
it without copying it:
    scores = parameter_token_scores(x, K_local, tau)
    row_max = local_row_max(scores, norm_type)            # softmax only; all-reduce MAX
    row_sum = local_row_sum(scores, norm_type, row_max)   # all-reduce SUM
    out = normalize_scores(scores, norm_type, row_sum, row_max, n) @ V_local   # all-reduce SUM
`pattention` composes them, with hooks where the statistics are combined across ranks: it is the
reference, differentiated by autograd. `fused_pattention` (below) computes the same values in one autograd
node that keeps one score-sized tensor for backward (a third of the activation memory) and makes few
passes over the scores, and `fused_pattentions` runs several Pattentions of one input (attention's
Q, K, V) in one such node. flash_pattention.py tiles the same math and keeps no score-sized tensor;
the layer (pattention_layer.py) runs the implementation the config picks. Statistics and Θ are
computed in at least fp32 (bf16/fp16 scores are upcast); the tensor saved for backward keeps the input
dtype.
"""

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.model.args import NORM_ACTIVATIONS

# Floor on the squared L2 norm of a score row: an all-zero row (e.g. a zero input) then gives zero
# weights instead of 0/0 = NaN. Real rows have squared norms many orders of magnitude above it.
ZERO_ROW_GUARD = 1e-12


def _at_least_fp32(scores: Tensor) -> Tensor:
    """bf16/fp16 scores upcast to fp32 for the statistics; fp32/fp64 kept as they are."""
    return scores.to(torch.promote_types(scores.dtype, torch.float32))


def _check_norm_type(norm_type: str) -> None:
    if norm_type not in NORM_ACTIVATIONS:
        raise ValueError(f"norm_activation_type={norm_type!r}: must be one of {NORM_ACTIVATIONS}")


def parameter_token_scores(x: Tensor, key_tokens: Tensor, tau: float) -> Tensor:
    """τ · X · K_Pᵀ: one score per (input token, parameter token), in the input dtype."""
    return F.linear(x, key_tokens) * tau


def local_row_max(scores: Tensor, norm_type: str) -> Tensor | None:
    """Row max of the scores (at least fp32, detached) for a stable softmax; None for the l2 variants.

    Detaching is exact: softmax does not depend on the shift, so no gradient flows through it.
    """
    _check_norm_type(norm_type)
    if norm_type != "softmax":
        return None
    return _at_least_fp32(scores.detach()).amax(dim=-1, keepdim=True)


def local_row_sum(scores: Tensor, norm_type: str, row_max: Tensor | None) -> Tensor:
    """The per-row sum Θ divides by, at least fp32, [..., 1]: Σa², ΣGeLU(a)², or Σexp(a − row_max).

    Sums over disjoint blocks of parameter tokens add up to the sum over all tokens.
    """
    _check_norm_type(norm_type)
    a = _at_least_fp32(scores)
    if norm_type == "l2_norm_gelu":
        return a.square().sum(dim=-1, keepdim=True)
    if norm_type == "gelu_l2_norm":
        return F.gelu(a).square().sum(dim=-1, keepdim=True)
    return torch.exp(a - row_max).sum(dim=-1, keepdim=True)


def normalize_scores(
    scores: Tensor,
    norm_type: str,
    row_sum: Tensor,
    row_max: Tensor | None,
    norm_token_count: int | Tensor,
) -> Tensor:
    """Θ applied to the scores, given row statistics over all parameter tokens; weights in at least fp32."""
    _check_norm_type(norm_type)
    a = _at_least_fp32(scores)
    n = torch.as_tensor(norm_token_count, dtype=a.dtype, device=a.device)
    if norm_type == "softmax":
        return torch.exp(a - row_max) / row_sum * n
    inverse_norm = torch.rsqrt(row_sum.clamp_min(ZERO_ROW_GUARD)) * n.sqrt()
    if norm_type == "l2_norm_gelu":
        return F.gelu(a * inverse_norm)
    return F.gelu(a) * inverse_norm


def _unchanged(statistic: Tensor) -> Tensor:
    return statistic


def pattention(
    x: Tensor,
    key_tokens: Tensor,
    value_tokens: Tensor,
    norm_type: str,
    tau: float,
    norm_token_count: int | Tensor,
    combine_row_max: Callable[[Tensor], Tensor] = _unchanged,
    combine_row_sum: Callable[[Tensor], Tensor] = _unchanged,
) -> Tensor:
    """Θ(τ · x · key_tokensᵀ) · value_tokens for x [..., d_in] -> [..., d_out].

    When key/value_tokens are one block of the layer's tokens, `combine_row_max` / `combine_row_sum`
    turn this block's row statistics into the whole layer's (all-reduces MAX / SUM over the blocks) and
    the result is this block's share of the output; by default the tokens are the whole layer.
    """
    scores = parameter_token_scores(x, key_tokens, tau)
    row_max = local_row_max(scores, norm_type)
    if row_max is not None:
        row_max = combine_row_max(row_max)
    row_sum = combine_row_sum(local_row_sum(scores, norm_type, row_max))
    weights = normalize_scores(scores, norm_type, row_sum, row_max, norm_token_count)
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
    norm_type: str,
    tau: float,
    norm_token_counts: Sequence[int | Tensor],
    reduce_sum: Callable[[Tensor], Tensor] = _unchanged,
    reduce_max: Callable[[Tensor], Tensor] = _unchanged,
) -> Tensor:
    """Several Pattentions of x by the reference formula ([B, ..., d_out]), with `fused_pattentions`'
    plain (non-autograd) reductions."""
    def combine_sum(statistic: Tensor) -> Tensor:
        return statistic if reduce_sum is _unchanged else _Combined.apply(statistic, reduce_sum)

    return torch.stack([pattention(x, k, v, norm_type, tau, n, reduce_max, combine_sum)
                        for k, v, n in zip(key_tokens, value_tokens, norm_token_counts)])


# --- The fused autograd node, used by the layers ---------------------------------------------------------
# Autograd through the plain formula keeps three score-sized tensors per layer
# ([tokens, n] each: A, the normalised scores, the GeLU output) and runs 14-20
# operators over them. On a CPU each pass over a score matrix costs a few percent
# of a GEMM, so the node below makes few passes, in place: forward keeps one
# score-sized tensor and a row statistic, backward recomputes at most one GeLU
# from it and applies the closed-form gradient of Θ, with at most two score-sized
# buffers alive (docs/performance.md counts the passes). τ is applied to X, and in
# forward the row factors of gelu_l2_norm and softmax to the output [tokens, d].
#
# With A = τ·X·Kᵀ, N the layer's token count, s a row statistic over all N
# tokens and c a row reduction of the incoming gradient (both summed over the
# tensor-parallel ranks by `reduce_sum`), r = √N/√s, dW = dY·Vᵀ:
#
#   l2_norm_gelu   Z = r·A (kept), W = GeLU(Z), Y = W·V
#                  dA = GeLU'(Z) ⊙ r·dW − (c/N)·Z,  c = Σ (GeLU'(Z) ⊙ r·dW)·Z
#                  (= r·dZ − (r·Σ dZ·A / s)·A with dZ = GeLU'(Z) ⊙ dW, as s·r² = N)
#   gelu_l2_norm   G = GeLU(A), A kept, Y = r·(G·V)
#                  dA = GeLU'(A) ⊙ (r·dW − (c/s)·G),  c = Σ (r·dW)·G
#   softmax        E = exp(A − m) (kept), q = N/s, Y = q·(E·V)
#                  dA = E ⊙ (q·dW − q·c/N),  c = Σ (q·dW)·E
#
# r·dW and q·dW are taken in place on the GEMM's output dY·Vᵀ, whatever the
# shapes: a choice that depended on N (say, scaling dY [tokens, d_out] instead
# when d_out < N) would round differently once growth appends zero-key tokens,
# and the old tokens' gradients would no longer be bit-identical to the un-grown
# layer's (tests/test_fused_pattention.py). The GEMMs themselves may still block
# a longer reduction differently (MKL: S·V over 512 zero-padded tokens vs 256),
# a rounding difference the plain formula shares. Rows whose s is below
# ZERO_ROW_GUARD get no gradient through s, as with the plain formula's clamp.
# Several Pattentions of the same input (attention's Q, K, V) run in one node,
# one Pattention at a time, so backward's buffers stay those of one.

Reduce = Callable[[Tensor], Tensor]


def _row_dot(a: Tensor, b: Tensor) -> Tensor:
    """Σ a·b along the last dim in at least fp32, [..., 1], in at most 16 blocks of rows (of at least 2¹⁶
    elements): the elementwise product (and a bf16/fp16 input's upcast) never takes a whole [rows, ·] buffer,
    which would raise the peak memory."""
    out = torch.empty(*a.shape[:-1], 1, dtype=torch.promote_types(a.dtype, torch.float32), device=a.device)
    rows = max(-(-a.shape[-2] // 16), 2**16 // a.shape[-1], 1)
    for a_rows, b_rows, out_rows in zip(a.split(rows, -2), b.split(rows, -2), out.split(rows, -2)):
        torch.linalg.vecdot(_at_least_fp32(a_rows), _at_least_fp32(b_rows), out=out_rows.squeeze(-1))
    return out


def _gelu_backward_(grad: Tensor, at: Tensor) -> Tensor:
    """GeLU'(at) ⊙ grad, written over grad."""
    return torch.ops.aten.gelu_backward.grad_input(grad, at, grad_input=grad)


def _normalize_(a: Tensor, norm_type: str, n: Tensor, reduce_sum: Reduce,
                reduce_max: Reduce) -> tuple[Tensor, Tensor, Tensor]:
    """Θ's forward on scores a [tokens, n], turning a into the tensor backward keeps (Z, A or E above).

    Returns (W without its row factor (l2_norm_gelu: W itself), the row statistic s, the row factor).
    """
    if norm_type == "softmax":
        a.sub_(reduce_max(a.amax(dim=-1, keepdim=True))).exp_()
        statistic = reduce_sum(a.sum(dim=-1, keepdim=True))
        return a, statistic, n / statistic
    g = F.gelu(a) if norm_type == "gelu_l2_norm" else a
    statistic = reduce_sum(torch.linalg.vector_norm(g, dim=-1, keepdim=True).square_())
    row = torch.rsqrt(statistic.clamp(min=ZERO_ROW_GUARD)).mul_(n.sqrt())
    return (g, statistic, row) if norm_type == "gelu_l2_norm" else (F.gelu(a.mul_(row)), statistic, row)


def _normalize_backward(s: Tensor, grad_out: Tensor, value: Tensor, norm_type: str, statistic: Tensor, row: Tensor,
                        n: Tensor, reduce_sum: Reduce) -> tuple[Tensor, Tensor]:
    """(dV, dA) of one Pattention from the kept tensor s and dY, by the formulas above."""
    weights = s if norm_type == "softmax" else F.gelu(s)
    # Y = W·V (l2_norm_gelu) or row·(W·V): dV = Wᵀ·dY or Wᵀ·(row·dY).
    grad_out_of_weights = grad_out if norm_type == "l2_norm_gelu" else (grad_out * row).to(grad_out.dtype)
    grad_value = torch.mm(weights.to(grad_out.dtype).t(), grad_out_of_weights)
    del grad_out_of_weights
    if norm_type == "l2_norm_gelu":
        del weights  # freed before the next score-sized buffer: at most two exist at once
    grad_weights = _at_least_fp32(torch.mm(grad_out, value.t())).mul_(row)  # row·dW in place: no buffer
    live = (statistic > ZERO_ROW_GUARD).to(s.dtype)
    if norm_type == "l2_norm_gelu":
        grad_scores = _gelu_backward_(grad_weights, s)
        c = reduce_sum(_row_dot(grad_scores, s))
        grad_scores.addcmul_(s, c.mul_(live).div_(n), value=-1)
    elif norm_type == "gelu_l2_norm":
        c = reduce_sum(_row_dot(grad_weights, weights))
        grad_weights.addcmul_(weights, c.mul_(live).div_(statistic.clamp(min=ZERO_ROW_GUARD)), value=-1)
        grad_scores = _gelu_backward_(grad_weights, s)
    else:
        c = reduce_sum(_row_dot(grad_weights, s))
        grad_scores = grad_weights.sub_(c.mul_(row).div_(n)).mul_(s)
    return grad_value, grad_scores.to(grad_out.dtype)


class _FusedPattention(torch.autograd.Function):
    """x [tokens, d_in], B keys [n, d_in], B values [n, d_out], token counts n [B] -> Y [B, tokens, d_out].

    The token matrices are separate inputs, not a stacked copy (backward keeps no copy of them). The B
    Pattentions share X (one input, one gradient buffer for it); Θ and backward run one at a time.
    """

    @staticmethod
    def forward(ctx, x, norm_type, tau, n, reduce_sum, reduce_max, *tokens):
        keys, values = tokens[:len(tokens) // 2], tokens[len(tokens) // 2:]
        if tau != 1.0:
            x = x * tau  # τ·X·Kᵀ = (τ·X)·Kᵀ: the scale lands on the small operand
        kept = x.new_empty(len(keys), len(x), len(keys[0]))
        out = x.new_empty(len(keys), len(x), values[0].shape[1])
        n = n.to(torch.promote_types(x.dtype, torch.float32))
        statistics, rows = [], []
        for key, value, n_b, kept_b, out_b in zip(keys, values, n, kept, out):
            a = _at_least_fp32(torch.mm(x, key.t(), out=kept_b))  # fp32: kept_b itself, modified in place
            weights, statistic, row = _normalize_(a, norm_type, n_b, reduce_sum, reduce_max)
            torch.mm(weights.to(x.dtype), value, out=out_b)
            if norm_type != "l2_norm_gelu":
                out_b.mul_(row)
            kept_b.copy_(a)  # bf16/fp16: back into the kept buffer; fp32: a is kept_b, no copy
            statistics.append(statistic)
            rows.append(row)
        ctx.save_for_backward(x, kept, torch.stack(statistics), torch.stack(rows), n, *tokens)
        ctx.norm_type, ctx.tau, ctx.reduce_sum = norm_type, tau, reduce_sum
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, kept, statistics, rows, n, *tokens = ctx.saved_tensors
        keys, values = tokens[:len(tokens) // 2], tokens[len(tokens) // 2:]
        grad_x, grad_keys, grad_values = None, [], []
        for b, (key, value) in enumerate(zip(keys, values)):
            grad_value, grad_scores = _normalize_backward(_at_least_fp32(kept[b]), grad_out[b], value, ctx.norm_type,
                                                          statistics[b], rows[b], n[b], ctx.reduce_sum)
            grad_values.append(grad_value)
            grad_keys.append(torch.mm(grad_scores.t(), x))
            grad_x = torch.mm(grad_scores, key) if grad_x is None else grad_x.addmm_(grad_scores, key)
        if ctx.tau != 1.0:
            grad_x.mul_(ctx.tau)
        return grad_x, None, None, None, None, None, *grad_keys, *grad_values


def fused_pattentions(
    x: Tensor,
    key_tokens: Sequence[Tensor],
    value_tokens: Sequence[Tensor],
    norm_type: str,
    tau: float,
    norm_token_counts: Sequence[int | Tensor],
    reduce_sum: Reduce = _unchanged,
    reduce_max: Reduce = _unchanged,
) -> Tensor:
    """Several Pattentions of the same input x [..., d_in] (same Θ and τ, equal token-matrix shapes) in one
    node: [B, ..., d_out], B = len(key_tokens); each equals `fused_pattention` with its own tokens."""
    _check_norm_type(norm_type)
    counts = torch.stack([torch.as_tensor(n, device=x.device) for n in norm_token_counts])
    out = _FusedPattention.apply(x.reshape(-1, x.shape[-1]), norm_type, float(tau), counts, reduce_sum, reduce_max,
                                 *key_tokens, *value_tokens)
    return out.view(len(key_tokens), *x.shape[:-1], value_tokens[0].shape[-1])


def fused_pattention(
    x: Tensor,
    key_tokens: Tensor,
    value_tokens: Tensor,
    norm_type: str,
    tau: float,
    norm_token_count: int | Tensor,
    reduce_sum: Reduce = _unchanged,
    reduce_max: Reduce = _unchanged,
) -> Tensor:
    """Same contract as `pattention.pattention`, computed by the fused autograd node.

    `reduce_sum` / `reduce_max` combine per-row statistics across the ranks that hold the other
    blocks of parameter tokens (plain, non-autograd all-reduces); identity for a whole layer.
    """
    return fused_pattentions(x, [key_tokens], [value_tokens], norm_type, tau, [norm_token_count],
                             reduce_sum, reduce_max).squeeze(0)
