"""The fused Pattention (`pattention_impl: fused`): theta.py's formula in one autograd node that keeps one
score-sized tensor for backward (a third of the plain formula's activation memory) and makes few passes over
the scores; `fused_pattentions` runs several Pattentions of one input (attention's Q, K, V) in one node.
Statistics are computed in at least fp32; the tensor saved for backward keeps the input dtype.

Autograd through the plain formula keeps three score-sized tensors per layer
([tokens, n] each: A, the normalised scores, the GeLU output) and runs 14-20
operators over them. On a CPU each pass over a score matrix costs a few percent
of a GEMM, so the node below makes few passes, in place: forward keeps one
score-sized tensor and a row statistic, backward recomputes at most one GeLU
from it and applies the closed-form gradient of Θ, with at most two score-sized
buffers alive (docs/performance.md counts the passes). τ is applied to X, and in
forward the row factors of gelu_l2_norm and softmax to the output [tokens, d].

With A = τ·X·Kᵀ, N the layer's token count, s a row statistic over all N
tokens and c a row reduction of the incoming gradient (both summed over the
tensor-parallel ranks by `reduce_sum`), r = √N/√s, dW = dY·Vᵀ:

  l2_norm_gelu   Z = r·A (kept), W = GeLU(Z), Y = W·V
                 dA = GeLU'(Z) ⊙ r·dW − (c/N)·Z,  c = Σ (GeLU'(Z) ⊙ r·dW)·Z
                 (= r·dZ − (r·Σ dZ·A / s)·A with dZ = GeLU'(Z) ⊙ dW, as s·r² = N)
  gelu_l2_norm   G = GeLU(A), A kept, Y = r·(G·V)
                 dA = GeLU'(A) ⊙ (r·dW − (c/s)·G),  c = Σ (r·dW)·G
  softmax        E = exp(A − m) (kept), q = N/s, Y = q·(E·V)
                 dA = E ⊙ (q·dW − q·c/N),  c = Σ (q·dW)·E

r·dW and q·dW are taken in place on the GEMM's output dY·Vᵀ, whatever the
shapes: a choice that depended on N (say, scaling dY [tokens, d_out] instead
when d_out < N) would round differently once growth appends zero-key tokens,
and the old tokens' gradients would no longer be bit-identical to the un-grown
layer's (tests/test_pattention_contract.py). The GEMMs themselves may still block
a longer reduction differently (MKL: S·V over 512 zero-padded tokens vs 256),
a rounding difference the plain formula shares. Rows whose s is below
ZERO_ROW_GUARD get no gradient through s, as with the plain formula's clamp.
Several Pattentions of the same input (attention's Q, K, V) run in one node,
one Pattention at a time, so backward's buffers stay those of one.
"""

from collections.abc import Sequence
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.model.pattention.theta import ZERO_ROW_GUARD, Reduce, at_least_fp32, check_theta, identity, row_dot


def _gelu_backward_(grad: Tensor, at: Tensor) -> Tensor:
    """GeLU'(at) ⊙ grad, written over grad."""
    return torch.ops.aten.gelu_backward.grad_input(grad, at, grad_input=grad)


def _normalize_(a: Tensor, theta: str, n: Tensor, reduce_sum: Reduce,
                reduce_max: Reduce) -> tuple[Tensor, Tensor, Tensor]:
    """Θ's forward on scores a [tokens, n], turning a into the tensor backward keeps (Z, A or E above).

    Returns (W without its row factor (l2_norm_gelu: W itself), the row statistic s, the row factor).
    """
    if theta == "softmax":
        a.sub_(reduce_max(a.amax(dim=-1, keepdim=True))).exp_()
        statistic = reduce_sum(a.sum(dim=-1, keepdim=True))
        return a, statistic, n / statistic
    g = F.gelu(a) if theta == "gelu_l2_norm" else a
    statistic = reduce_sum(torch.linalg.vector_norm(g, dim=-1, keepdim=True).square_())
    row = torch.rsqrt(statistic.clamp(min=ZERO_ROW_GUARD)).mul_(n.sqrt())
    return (g, statistic, row) if theta == "gelu_l2_norm" else (F.gelu(a.mul_(row)), statistic, row)


def _normalize_backward(s: Tensor, grad_out: Tensor, value: Tensor, theta: str, statistic: Tensor, row: Tensor,
                        n: Tensor, reduce_sum: Reduce) -> tuple[Tensor, Tensor]:
    """(dV, dA) of one Pattention from the kept tensor s and dY, by the formulas above."""
    weights = s if theta == "softmax" else F.gelu(s)
    # Y = W·V (l2_norm_gelu) or row·(W·V): dV = Wᵀ·dY or Wᵀ·(row·dY).
    grad_out_of_weights = grad_out if theta == "l2_norm_gelu" else (grad_out * row).to(grad_out.dtype)
    grad_value = torch.mm(weights.to(grad_out.dtype).t(), grad_out_of_weights)
    del grad_out_of_weights
    if theta == "l2_norm_gelu":
        del weights  # freed before the next score-sized buffer: at most two exist at once
    grad_weights = at_least_fp32(torch.mm(grad_out, value.t())).mul_(row)  # row·dW in place: no buffer
    live = (statistic > ZERO_ROW_GUARD).to(s.dtype)
    if theta == "l2_norm_gelu":
        grad_scores = _gelu_backward_(grad_weights, s)
        c = reduce_sum(row_dot(grad_scores, s))
        grad_scores.addcmul_(s, c.mul_(live).div_(n), value=-1)
    elif theta == "gelu_l2_norm":
        c = reduce_sum(row_dot(grad_weights, weights))
        grad_weights.addcmul_(weights, c.mul_(live).div_(statistic.clamp(min=ZERO_ROW_GUARD)), value=-1)
        grad_scores = _gelu_backward_(grad_weights, s)
    else:
        c = reduce_sum(row_dot(grad_weights, s))
        grad_scores = grad_weights.sub_(c.mul_(row).div_(n)).mul_(s)
    return grad_value, grad_scores.to(grad_out.dtype)


def normalize_by_tiles(a: Tensor, theta: str, n: Tensor, tiles: ModuleType, reduce_sum: Reduce, reduce_max: Reduce,
                       root_n: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Θ's forward on whole score rows a [rows, n] by a tile backend's functions (one kernel pass or two, a left
    as it is: fused keeps it; flash calls this on each block of rows, passing √n, `root_n`, made once). Returns
    (W without its row factor, s, the row factor, softmax's row max), the statistics [rows, 1] in fp32."""
    if theta == "softmax":
        row_max = reduce_max(at_least_fp32(a.amax(dim=-1, keepdim=True)))
        weights, total = tiles.softmax_forward(a, row_max)
        statistic = reduce_sum(total)
        return weights, statistic, n / statistic, row_max
    if theta == "gelu_l2_norm":
        weights, squares = tiles.gelu_l2_norm_forward(a)
        statistic = reduce_sum(squares)
    else:
        weights, statistic = None, reduce_sum(tiles.sum_squares(a))
    row = torch.rsqrt(statistic.clamp(min=ZERO_ROW_GUARD)).mul_(n.sqrt() if root_n is None else root_n)
    return weights if weights is not None else tiles.l2_norm_gelu_forward(a, row), statistic, row, None


def normalize_backward_by_tiles(a: Tensor, grad_out: Tensor, value: Tensor, theta: str, statistic: Tensor,
                                row: Tensor, row_max: Tensor | None, n: Tensor, tiles: ModuleType,
                                reduce_sum: Reduce, live: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(W', dA) of one Pattention from whole score rows a [rows, n] and their dY by a tile backend's functions:
    one pass for the row reduction c, one for dA and W', the weights with their row factor (dV = W'ᵀ·dY).
    `live`, 1 where the statistic is above ZERO_ROW_GUARD and 0 elsewhere, is made here unless given (flash
    makes it once for all its blocks)."""
    grad_weights = torch.mm(grad_out, value.t())
    if live is None:
        live = (statistic > ZERO_ROW_GUARD).to(statistic.dtype)
    if theta == "l2_norm_gelu":
        c = reduce_sum(tiles.l2_norm_gelu_backward_dot(a, grad_weights, row))
        weights, grad_scores = tiles.l2_norm_gelu_gradient(a, grad_weights, row, c.mul_(live).div_(n))
    elif theta == "gelu_l2_norm":
        c = reduce_sum(tiles.gelu_l2_norm_backward_dot(a, grad_weights, row))
        coef = c.mul_(live).div_(statistic.clamp(min=ZERO_ROW_GUARD))
        weights, grad_scores = tiles.gelu_l2_norm_backward(a, grad_weights, row, coef)
    else:
        c = reduce_sum(tiles.softmax_backward_dot(a, grad_weights, row_max, row))
        weights, grad_scores = tiles.softmax_backward(a, grad_weights, row_max, row, c.mul_(row).div_(n))
    del grad_weights
    return weights, grad_scores


class _FusedPattention(torch.autograd.Function):
    """x [tokens, d_in], B keys [n, d_in], B values [n, d_out], token counts n [B] -> Y [B, tokens, d_out].

    The token matrices are separate inputs, not a stacked copy (backward keeps no copy of them). The B
    Pattentions share X (one input, one gradient buffer for it); Θ and backward run one at a time. With a tile
    backend (`tiles`), Θ runs in its functions and the scores A are kept; without, in the PyTorch passes above.
    """

    @staticmethod
    def forward(ctx, x, theta, tau, n, reduce_sum, reduce_max, tiles, *tokens):
        keys, values = tokens[:len(tokens) // 2], tokens[len(tokens) // 2:]
        if tau != 1.0:
            x = x * tau  # τ·X·Kᵀ = (τ·X)·Kᵀ: the scale lands on the small operand
        kept = x.new_empty(len(keys), len(x), len(keys[0]))
        out = x.new_empty(len(keys), len(x), values[0].shape[1])
        n = n.to(torch.promote_types(x.dtype, torch.float32))
        statistics, rows, row_maxes = [], [], []
        for key, value, n_b, kept_b, out_b in zip(keys, values, n, kept, out):
            if tiles is None:
                a = at_least_fp32(torch.mm(x, key.t(), out=kept_b))  # fp32: kept_b itself, modified in place
                weights, statistic, row = _normalize_(a, theta, n_b, reduce_sum, reduce_max)
                kept_b.copy_(a)  # bf16/fp16: back into the kept buffer; fp32: a is kept_b, no copy
            else:
                weights, statistic, row, row_max = normalize_by_tiles(torch.mm(x, key.t(), out=kept_b), theta, n_b,
                                                                      tiles, reduce_sum, reduce_max)
                row_maxes.append(row_max)
            torch.mm(weights.to(x.dtype), value, out=out_b)
            del weights
            if theta != "l2_norm_gelu":
                out_b.mul_(row)
            statistics.append(statistic)
            rows.append(row)
        row_maxes = torch.stack(row_maxes) if theta == "softmax" and tiles is not None else None
        ctx.save_for_backward(x, kept, torch.stack(statistics), torch.stack(rows), row_maxes, n, *tokens)
        ctx.theta, ctx.tau, ctx.reduce_sum, ctx.tiles = theta, tau, reduce_sum, tiles
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, kept, statistics, rows, row_maxes, n, *tokens = ctx.saved_tensors
        keys, values = tokens[:len(tokens) // 2], tokens[len(tokens) // 2:]
        grad_x, grad_keys, grad_values = None, [], []
        for b, (key, value) in enumerate(zip(keys, values)):
            if ctx.tiles is None:
                grad_value, grad_scores = _normalize_backward(at_least_fp32(kept[b]), grad_out[b], value, ctx.theta,
                                                              statistics[b], rows[b], n[b], ctx.reduce_sum)
            else:
                weights, grad_scores = normalize_backward_by_tiles(
                    kept[b], grad_out[b], value, ctx.theta, statistics[b], rows[b],
                    None if row_maxes is None else row_maxes[b], n[b], ctx.tiles, ctx.reduce_sum)
                grad_value = torch.mm(weights.t(), grad_out[b])
                del weights
            grad_values.append(grad_value)
            grad_keys.append(torch.mm(grad_scores.t(), x))
            grad_x = torch.mm(grad_scores, key) if grad_x is None else grad_x.addmm_(grad_scores, key)
            del grad_scores
        if ctx.tau != 1.0:
            grad_x.mul_(ctx.tau)
        return grad_x, None, None, None, None, None, None, *grad_keys, *grad_values


def fused_pattentions(
    x: Tensor,
    key_tokens: Sequence[Tensor],
    value_tokens: Sequence[Tensor],
    theta: str,
    tau: float,
    norm_token_counts: Sequence[int | Tensor],
    reduce_sum: Reduce = identity,
    reduce_max: Reduce = identity,
    tiles: ModuleType | None = None,
) -> Tensor:
    """Several Pattentions of the same input x [..., d_in] (same Θ and τ, equal token-matrix shapes) in one
    node: [B, ..., d_out], B = len(key_tokens); each equals `fused_pattention` with its own tokens. `tiles`, a
    tile backend (tiles_triton: registry.py passes it on CUDA), runs Θ in its kernels instead of PyTorch passes."""
    check_theta(theta)
    counts = torch.stack([torch.as_tensor(n, device=x.device) for n in norm_token_counts])
    out = _FusedPattention.apply(x.reshape(-1, x.shape[-1]), theta, float(tau), counts, reduce_sum, reduce_max,
                                 tiles, *key_tokens, *value_tokens)
    return out.view(len(key_tokens), *x.shape[:-1], value_tokens[0].shape[-1])


def fused_pattention(
    x: Tensor,
    key_tokens: Tensor,
    value_tokens: Tensor,
    theta: str,
    tau: float,
    norm_token_count: int | Tensor,
    reduce_sum: Reduce = identity,
    reduce_max: Reduce = identity,
) -> Tensor:
    """Same contract as plain.py's `pattention`, computed by the fused autograd node.

    `reduce_sum` / `reduce_max` combine per-row statistics across the ranks that hold the other
    blocks of parameter tokens (plain, non-autograd all-reduces); identity for a whole layer.
    """
    return fused_pattentions(x, [key_tokens], [value_tokens], theta, tau, [norm_token_count],
                             reduce_sum, reduce_max).squeeze(0)
