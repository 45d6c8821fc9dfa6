"""Flash Pattention: Θ(τ·X·K_Pᵀ)·V_P without ever holding the [tokens × n] score matrix of all input rows.

The input rows are visited in blocks of ROWS. Θ normalises each score row on its own (its statistics are
sums or maxima over that row's n entries), so a block of whole rows is normalised exactly as the fused node
normalises all of them: each block's scores A_r = τ·X_r·K_Pᵀ are made, normalised by fused.py's functions on
the tile backend (`tiles`: tiles_torch.py or tiles_triton.py, chosen by registry.py), multiplied by V_P and
dropped. Backward recomputes each block's scores from the saved input: seven GEMMs where the fused node does
six, and nothing else, whatever Θ. What one Pattention keeps for backward is its input and fp32 row statistics
(s and the row factor; softmax also its row max), 8 or 12 bytes a token whatever n is; what it holds while it
runs is a few [ROWS, n] buffers, ROWS/tokens of the fused node's.

ROWS is fixed per device type, never derived from n or from the token count, so that
  - every tensor-parallel rank cuts the same blocks: the row statistics' all-reduces (`reduce_sum`,
    `reduce_max`, one or two per block in forward and one in backward, as the fused node makes for all rows)
    match across ranks even where the ranks hold different numbers of parameter tokens;
  - growth (zero keys appended) leaves the blocks as they were: dK and dV are summed over the same blocks in the
    same order, so the old tokens' gradients round as before wherever the fused node's do.
dK and dV are summed over the blocks in at least fp32; where torch multiplies bf16 into fp32 (CUDA), each
block's product goes into the sum unrounded (`accumulate`). dX of the Pattentions of one input (attention's Q,
K and V) is summed for a block in at least fp32 before it is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch
from torch import Tensor

from megatron.model.pattention import tiles_torch
from megatron.model.pattention.fused import normalize_backward_by_tiles, normalize_by_tiles
from megatron.model.pattention.theta import Reduce, check_theta, identity

# Input rows a block, by device type. A GPU wants GEMMs of a few thousand rows to fill its SMs (at the 1-5B FFN,
# n = 6144, a bf16 [2048, n] buffer is 24 MiB; backward holds four; benchmarks.gpu_pattention --rows-sweep times
# the choice). On a CPU more rows run faster, but at 1024 tokens 128 rows already hold 0.43 of the fused node's
# peak memory (benchmarks/RESULTS.md).
ROWS = {"cpu": 64, "default": 2048}


def row_blocks(tokens: int, device: torch.device) -> list[slice]:
    """The blocks of input rows flash visits, in order."""
    rows = ROWS.get(device.type, ROWS["default"])
    return [slice(start, min(start + rows, tokens)) for start in range(0, tokens, rows)]


_PROBES: dict[tuple[str, str, torch.dtype], bool] = {}


def _probe(name: str, device: torch.device, dtype: torch.dtype, check) -> bool:
    """check(2 × 2 ones in `dtype` on `device`), once per (name, device type, dtype); False where torch refuses."""
    key = (name, device.type, dtype)
    if key not in _PROBES:
        try:
            _PROBES[key] = bool(check(torch.ones(2, 2, dtype=dtype, device=device)))
        except (RuntimeError, TypeError, NotImplementedError):
            _PROBES[key] = False
    return _PROBES[key]


def wide_output_matmul(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch multiplies `dtype` (bf16/fp16) matrices on `device` straight into fp32
    (torch.mm(..., out_dtype=torch.float32): CUDA in recent torch; not on a CPU)."""
    return _probe("mm", device, dtype, lambda one: torch.mm(one, one, out_dtype=torch.float32).dtype == torch.float32)


def _wide_output_addmm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch.addmm(t, a, b, out_dtype=fp32, out=t) adds a `dtype` product into fp32 `t` in place: the GEMM
    adds it as it writes, with no fp32 product made and added in a second pass."""
    def check(one: Tensor) -> bool:
        target = torch.ones(2, 2, device=one.device)
        torch.addmm(target, one, one, out_dtype=torch.float32, alpha=-1, out=target)
        return bool((target == -1).all())
    return _probe("addmm", device, dtype, check)


def accumulate(target: Tensor, a: Tensor, b: Tensor) -> None:
    """target += a·b, target in at least fp32 (a and b may be bf16/fp16): where torch offers it, the product
    comes out in fp32 too, instead of each block's product being rounded to bf16 before the sum."""
    if target.dtype == a.dtype:
        target.addmm_(a, b)
    elif target.is_contiguous() and _wide_output_addmm(a.device, a.dtype):
        torch.addmm(target, a, b, out_dtype=target.dtype, out=target)
    elif wide_output_matmul(a.device, a.dtype):
        target.add_(torch.mm(a, b, out_dtype=target.dtype))
    else:
        target.add_(torch.mm(a, b))


class _FlashPattention(torch.autograd.Function):
    """x [tokens, d_in], B keys [n, d_in], B values [n, d_out], token counts n [B] -> Y [B, tokens, d_out];
    the contract of fused.py's _FusedPattention, block of rows by block of rows."""

    @staticmethod
    def forward(ctx, x, theta, tau, n, reduce_sum, reduce_max, tiles, *tokens):
        keys, values = tokens[:len(tokens) // 2], tokens[len(tokens) // 2:]
        if tau != 1.0:
            x = x * tau
        n = n.to(torch.promote_types(x.dtype, torch.float32))
        out = x.new_empty(len(keys), len(x), values[0].shape[1])
        statistics = torch.empty(len(keys), len(x), 1, dtype=n.dtype, device=x.device)
        rows = torch.empty_like(statistics)
        row_maxes = torch.empty_like(statistics) if theta == "softmax" else None
        for b, (key, value) in enumerate(zip(keys, values)):
            for r in row_blocks(len(x), x.device):
                weights, statistics[b, r], rows[b, r], row_max = normalize_by_tiles(
                    torch.mm(x[r], key.t()), theta, n[b], tiles, reduce_sum, reduce_max)
                torch.mm(weights, value, out=out[b, r])
                del weights  # before the next block's scores exist
                if theta != "l2_norm_gelu":
                    out[b, r].mul_(rows[b, r])
                if row_maxes is not None:
                    row_maxes[b, r] = row_max
        ctx.save_for_backward(x, n, statistics, rows, row_maxes, *tokens)
        ctx.theta, ctx.tau, ctx.reduce_sum, ctx.tiles = theta, tau, reduce_sum, tiles
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, n, statistics, rows, row_maxes, *tokens = ctx.saved_tensors
        keys, values = tokens[:len(tokens) // 2], tokens[len(tokens) // 2:]
        grad_out = grad_out.contiguous()
        acc_dtype = torch.promote_types(x.dtype, torch.float32)
        grad_x = torch.empty_like(x)
        grad_keys = [torch.zeros(key.shape, dtype=acc_dtype, device=x.device) for key in keys]
        grad_values = [torch.zeros(value.shape, dtype=acc_dtype, device=x.device) for value in values]
        for r in row_blocks(len(x), x.device):
            grad_x_block = grad_x[r].zero_() if acc_dtype == x.dtype else x.new_zeros(grad_x[r].shape, dtype=acc_dtype)
            for b, (key, value) in enumerate(zip(keys, values)):
                weights, grad_scores = normalize_backward_by_tiles(
                    torch.mm(x[r], key.t()), grad_out[b, r], value, ctx.theta, statistics[b, r], rows[b, r],
                    None if row_maxes is None else row_maxes[b, r], n[b], ctx.tiles, ctx.reduce_sum)
                accumulate(grad_values[b], weights.t(), grad_out[b, r])
                del weights
                accumulate(grad_keys[b], grad_scores.t(), x[r])
                accumulate(grad_x_block, grad_scores, key)
                del grad_scores
            if grad_x_block.dtype != x.dtype:
                grad_x[r].copy_(grad_x_block)
        if ctx.tau != 1.0:
            grad_x.mul_(ctx.tau)
        return (grad_x, None, None, None, None, None, None, *(g.to(k.dtype) for g, k in zip(grad_keys, keys)),
                *(g.to(v.dtype) for g, v in zip(grad_values, values)))


def flash_pattentions(
    x: Tensor,
    key_tokens: Sequence[Tensor],
    value_tokens: Sequence[Tensor],
    theta: str,
    tau: float,
    norm_token_counts: Sequence[int | Tensor],
    reduce_sum: Reduce = identity,
    reduce_max: Reduce = identity,
    tiles: ModuleType = tiles_torch,
) -> Tensor:
    """`fused_pattentions`' contract ([B, ..., d_out]), computed block of rows by block of rows with the Θ
    functions of `tiles` (a tile backend: tiles_torch or tiles_triton; registry.py picks one by name)."""
    check_theta(theta)
    counts = torch.stack([torch.as_tensor(n, device=x.device) for n in norm_token_counts])
    out = _FlashPattention.apply(x.reshape(-1, x.shape[-1]), theta, float(tau), counts, reduce_sum, reduce_max,
                                 tiles, *key_tokens, *value_tokens)
    return out.view(len(key_tokens), *x.shape[:-1], value_tokens[0].shape[-1])
