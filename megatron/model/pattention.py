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
node that keeps only the scores for backward (a third of the activation memory); layers use it.
Statistics and Θ are computed in at least fp32 (bf16/fp16 scores are upcast).
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron.model.args import NORM_ACTIVATIONS
from megatron.model.init_methods import InitRole

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


# --- The memory-efficient autograd node, used by the layers -------------------------------------------
# Autograd through the plain formula above keeps three score-sized
# tensors per layer alive for backward (the scores A, the normalised scores and
# the GeLU output, [tokens, n] each) and runs a dozen element-wise passes in
# backward. Here forward saves only A and one statistic per row; backward
# recomputes the element-wise chain from A and applies the closed-form gradient
# of the normalisation. Values and gradients equal the plain formula's (tests).
#
# Backward, per row, with s the row statistic over all N parameter tokens and
# c a row reduction of the incoming gradient (also over all tokens):
#
#     l2_norm_gelu:  Z = A·r, r = √N/√s, s = ΣA²      dZ = dS ⊙ GeLU'(Z)
#                    dA = r·dZ − (r·c/s)·A,            c = Σ dZ·A
#     gelu_l2_norm:  S = G·r, G = GeLU(A), s = ΣG²
#                    dG = r·dS − (r·c/s)·G,            c = Σ dS·G,   dA = dG ⊙ GeLU'(A)
#     softmax:       S = N·exp(A − m)/s, s = Σexp(A − m)
#                    dA = S ⊙ (dS − c/N),              c = Σ dS·S
#
# For tensor parallelism (each rank holding a block of the N tokens) the row
# statistics and c are summed over ranks by the `reduce_sum` / `reduce_max`
# callables; the output is this block's partial sum, as with the plain formula.

Reduce = Callable[[Tensor], Tensor]


def _gelu_grad(grad: Tensor, at: Tensor) -> Tensor:
    return torch.ops.aten.gelu_backward(grad, at)


class _FusedPattention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, key_tokens, value_tokens, norm_type, tau, n, reduce_sum, reduce_max):
        scores = F.linear(x, key_tokens) * tau if tau != 1.0 else F.linear(x, key_tokens)
        a = _at_least_fp32(scores)
        # n stays a tensor (no host sync on accelerators; a meta-device model runs too).
        n = torch.as_tensor(n, device=a.device).to(a.dtype)
        if norm_type == "softmax":
            row_max = reduce_max(a.amax(dim=-1, keepdim=True))
            weights = torch.exp(a - row_max)
            statistic = reduce_sum(weights.sum(dim=-1, keepdim=True))
            weights.mul_(n / statistic)
        else:
            row_max = None
            g = F.gelu(a) if norm_type == "gelu_l2_norm" else a
            statistic = reduce_sum(torch.linalg.vector_norm(g, dim=-1, keepdim=True).square_())
            scale = torch.rsqrt(statistic.clamp(min=ZERO_ROW_GUARD)).mul_(n.sqrt())
            weights = F.gelu(a * scale) if norm_type == "l2_norm_gelu" else g.mul_(scale)
        ctx.save_for_backward(x, key_tokens, value_tokens, scores, statistic, row_max, n)
        ctx.norm_type, ctx.tau, ctx.reduce_sum = norm_type, tau, reduce_sum
        return torch.matmul(weights.to(scores.dtype), value_tokens)

    @staticmethod
    def backward(ctx, grad_out):
        x, key_tokens, value_tokens, scores, statistic, row_max, n = ctx.saved_tensors
        norm_type, reduce_sum = ctx.norm_type, ctx.reduce_sum
        a = _at_least_fp32(scores)
        grad_weights = torch.matmul(grad_out, value_tokens.t()).to(a.dtype)
        if norm_type == "softmax":
            weights = torch.exp(a - row_max).mul_(n / statistic)
            c = reduce_sum(torch.linalg.vecdot(grad_weights, weights).unsqueeze(-1))
            grad_scores = grad_weights.sub_(c / n).mul_(weights)
        else:
            clamped = statistic.clamp(min=ZERO_ROW_GUARD)
            scale = torch.rsqrt(clamped).mul_(n.sqrt())
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
    reduce_sum: Reduce = _unchanged,
    reduce_max: Reduce = _unchanged,
) -> Tensor:
    """Same contract as `pattention.pattention`, computed by the memory-efficient autograd node.

    `reduce_sum` / `reduce_max` combine per-row statistics across the ranks that hold the other
    blocks of parameter tokens (plain, non-autograd all-reduces); identity for a whole layer.
    """
    _check_norm_type(norm_type)
    return _FusedPattention.apply(x, key_tokens, value_tokens, norm_type, float(tau), norm_token_count,
                                  reduce_sum, reduce_max)


class Pattention(nn.Module):
    """A Pattention layer d_in -> d_out with `num_tokens` key/value parameter tokens.

    Parameters `key_param_tokens` [n, d_in] and `value_param_tokens` [n, d_out] keep the official names;
    they are left uninitialised here (see `initialize_parameters`). `norm_token_count` (int64, saved in
    the state_dict) is the n of √n / ·n: `num_tokens` unless given (a tensor-parallel block holds fewer
    tokens than the layer it normalises as).
    """

    def __init__(
        self,
        input_dim: int,
        output_dim: int,
        num_tokens: int,
        norm_type: str,
        tau: float = 1.0,
        device: str | torch.device | None = None,
        norm_token_count: int | None = None,
    ) -> None:
        super().__init__()
        _check_norm_type(norm_type)
        self.norm_type = norm_type
        self.tau = tau
        self.key_param_tokens = nn.Parameter(torch.empty(num_tokens, input_dim, device=device))
        self.value_param_tokens = nn.Parameter(torch.empty(num_tokens, output_dim, device=device))
        self.register_buffer("norm_token_count",
                             torch.tensor(num_tokens if norm_token_count is None else norm_token_count,
                                          dtype=torch.int64, device=device))

    def init_roles(self) -> dict[str, InitRole]:
        """Official init: keys use `init_method`, values use `output_layer_init_method`."""
        return {"key_param_tokens": InitRole.INPUT, "value_param_tokens": InitRole.OUTPUT}

    def forward(self, x: Tensor) -> Tensor:
        return fused_pattention(x, self.key_param_tokens, self.value_param_tokens, self.norm_type, self.tau,
                                self.norm_token_count)

    def extra_repr(self) -> str:
        n, d_in = self.key_param_tokens.shape
        return f"{d_in} -> {self.value_param_tokens.shape[1]}, tokens={n}, norm={self.norm_type}, tau={self.tau}"
