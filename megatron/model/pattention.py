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
Statistics and Θ are computed in at least fp32 (bf16/fp16 scores are upcast).
"""

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


def pattention(
    x: Tensor,
    key_tokens: Tensor,
    value_tokens: Tensor,
    norm_type: str,
    tau: float,
    norm_token_count: int | Tensor,
) -> Tensor:
    """Θ(τ · x · key_tokensᵀ) · value_tokens for x [..., d_in] -> [..., d_out] on a single device."""
    scores = parameter_token_scores(x, key_tokens, tau)
    row_max = local_row_max(scores, norm_type)
    row_sum = local_row_sum(scores, norm_type, row_max)
    weights = normalize_scores(scores, norm_type, row_sum, row_max, norm_token_count)
    return torch.matmul(weights.to(scores.dtype), value_tokens)


class Pattention(nn.Module):
    """A Pattention layer d_in -> d_out with `num_tokens` key/value parameter tokens.

    Parameters `key_param_tokens` [n, d_in] and `value_param_tokens` [n, d_out] keep the official names;
    they are left uninitialised here (see `initialize_parameters`). `norm_token_count` (int64, saved in
    the state_dict) is the n of √n / ·n.
    """

    def __init__(
        self,
        input_dim: int,
        output_dim: int,
        num_tokens: int,
        norm_type: str,
        tau: float = 1.0,
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__()
        _check_norm_type(norm_type)
        self.norm_type = norm_type
        self.tau = tau
        self.key_param_tokens = nn.Parameter(torch.empty(num_tokens, input_dim, device=device))
        self.value_param_tokens = nn.Parameter(torch.empty(num_tokens, output_dim, device=device))
        self.register_buffer("norm_token_count", torch.tensor(num_tokens, dtype=torch.int64, device=device))

    def init_roles(self) -> dict[str, InitRole]:
        """Official init: keys use `init_method`, values use `output_layer_init_method`."""
        return {"key_param_tokens": InitRole.INPUT, "value_param_tokens": InitRole.OUTPUT}

    def forward(self, x: Tensor) -> Tensor:
        return pattention(x, self.key_param_tokens, self.value_param_tokens, self.norm_type, self.tau,
                          self.norm_token_count)

    def extra_repr(self) -> str:
        n, d_in = self.key_param_tokens.shape
        return f"{d_in} -> {self.value_param_tokens.shape[1]}, tokens={n}, norm={self.norm_type}, tau={self.tau}"
