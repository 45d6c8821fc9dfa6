"""Flash Pattention: Θ(τ·X·K_Pᵀ)·V_P without ever holding the [tokens × n] score matrix of all input rows, in
blocks of rows, Θ on the PyTorch or the Triton tile backend (with flash_backend: kernels the l2 Θ run
flash_triton.py's kernels instead, which hold no score block either; registry.py chooses).

The input rows are cut into at most BLOCKS blocks of whole rows (row_blocks: ceil(tokens / BLOCKS) rows a
block, never fewer than the device type's MIN_ROWS). Θ normalises each score row on its own (its statistics
are sums or maxima over that row's n entries), so a block of whole rows is normalised exactly as the fused node
normalises all of them: each block's scores A_r = τ·X_r·K_Pᵀ are made, normalised by fused.py's functions on
the tile backend (`tiles`: tiles_torch.py or tiles_triton.py, chosen by registry.py), multiplied by V_P and
dropped. Backward recomputes each block's scores from the saved input: seven GEMMs where the fused node does
six, and nothing else, whatever Θ. What one Pattention keeps for backward is its input and fp32 row statistics
(s and the row factor; softmax also its row max), 8 or 12 bytes a token whatever n is; what it holds while it
runs is a few [rows, n] buffers, about 1/BLOCKS of the fused node's.

The number of blocks, not their size, is what is fixed: the host work and the operators launched per call
(a fixed number per block) do not grow with the token count, and at a small token count (one block) flash
launches what the fused node launches, plus a GEMM and a fixed few (splits, one cat per row statistic). The
blocks depend on the token count and the device type alone, never on n, so that
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
from megatron.model.pattention.theta import ZERO_ROW_GUARD, Reduce, check_theta, identity

# Blocks of input rows a call cuts, at most, by device type: backward's [rows, n] buffers are then 1/BLOCKS of a
# [tokens, n] one whatever the token count, so flash's peak against the fused node's stays as it is across
# micro-batches (where MIN_ROWS does not bind). The peak target (at most 0.35 of fused's at n >= 4d) sets the
# number; a CPU needs more blocks, because its PyTorch tiles hold more [rows, n] buffers than the fused node holds
# [tokens, n] ones. The sweeps that chose both figures: benchmarks/RESULTS.md ("Flash Pattention's host work") and
# benchmarks.gpu_pattention --blocks-sweep.
BLOCKS = {"cpu": 16, "default": 8}
# The fewest input rows a block, by device type, so that small inputs run in one block or a few (one block: the
# operators of the fused node and one GEMM more): on a GPU, blocks of a few thousand rows fill the SMs and keep
# the launches few; on a CPU the memory test's 1024 tokens already need 64-row blocks
# (tests/test_pattention_kernels.py).
MIN_ROWS = {"cpu": 64, "default": 2048}


def rows_per_block(tokens: int, device: torch.device) -> int:
    """Input rows of each of flash's blocks (the last may hold fewer): ceil(tokens / BLOCKS), at least MIN_ROWS
    (both by `device`'s type)."""
    blocks = BLOCKS.get(device.type, BLOCKS["default"])
    return max(MIN_ROWS.get(device.type, MIN_ROWS["default"]), -(-tokens // blocks), 1)


def row_blocks(tokens: int, device: torch.device) -> list[slice]:
    """The blocks of input rows flash visits, in order: at most BLOCKS, whatever the token count."""
    rows = rows_per_block(tokens, device)
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
        root_n = n.sqrt()  # once, not per block
        rows_a_block = rows_per_block(len(x), x.device)
        x_blocks = x.split(rows_a_block)
        out = x.new_empty(len(keys), len(x), values[0].shape[1])
        statistics, rows, row_maxes = [], [], []  # per Pattention and block; one cat each after the loop
        for key, value, n_b, root_n_b, out_b in zip(keys, values, n, root_n, out):
            key_t = key.t()
            for x_r, out_r in zip(x_blocks, out_b.split(rows_a_block)):
                weights, statistic, row, row_max = normalize_by_tiles(
                    torch.mm(x_r, key_t), theta, n_b, tiles, reduce_sum, reduce_max, root_n_b)
                torch.mm(weights, value, out=out_r)
                del weights  # before the next block's scores exist
                if theta != "l2_norm_gelu":
                    out_r.mul_(row)
                statistics.append(statistic)
                rows.append(row)
                row_maxes.append(row_max)

        def per_row(blocks: list[Tensor]) -> Tensor:  # [B, tokens, 1] in n's dtype, at least fp32
            return torch.cat(blocks).view(len(keys), len(x), 1).to(n.dtype)

        row_maxes = per_row(row_maxes) if theta == "softmax" else None
        ctx.save_for_backward(x, n, per_row(statistics), per_row(rows), row_maxes, *tokens)
        ctx.theta, ctx.tau, ctx.reduce_sum, ctx.tiles = theta, tau, reduce_sum, tiles
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, n, statistics, rows, row_maxes, *tokens = ctx.saved_tensors
        keys, values = tokens[:len(tokens) // 2], tokens[len(tokens) // 2:]
        grad_out = grad_out.contiguous()
        acc_dtype = torch.promote_types(x.dtype, torch.float32)
        rows_a_block = rows_per_block(len(x), x.device)
        grad_x = torch.empty_like(x)
        grad_keys = [torch.zeros(key.shape, dtype=acc_dtype, device=x.device) for key in keys]
        grad_values = [torch.zeros(value.shape, dtype=acc_dtype, device=x.device) for value in values]
        live = (statistics > ZERO_ROW_GUARD).to(statistics.dtype)  # once for all blocks
        # dX of a block is summed over the Pattentions in at least fp32: one buffer for every block
        block_sum = None if acc_dtype == x.dtype else x.new_empty(rows_a_block, x.shape[1], dtype=acc_dtype)

        # Every per-row tensor cut into its blocks once (views), not indexed per block.
        def blocks(t: Tensor | None) -> list:
            return [None] * len(keys) if t is None else [t_b.split(rows_a_block) for t_b in t]

        per_pattention = list(zip(keys, [key.t() for key in keys], values, n, blocks(grad_out), blocks(statistics),
                                  blocks(rows), blocks(row_maxes), blocks(live), grad_keys, grad_values))
        for r, (x_r, grad_x_r) in enumerate(zip(x.split(rows_a_block), grad_x.split(rows_a_block))):
            grad_x_block = grad_x_r.zero_() if block_sum is None else block_sum[:len(x_r)].zero_()
            for key, key_t, value, n_b, grad_out_b, statistic_b, row_b, row_max_b, live_b, grad_key, grad_value \
                    in per_pattention:
                weights, grad_scores = normalize_backward_by_tiles(
                    torch.mm(x_r, key_t), grad_out_b[r], value, ctx.theta, statistic_b[r], row_b[r],
                    None if row_max_b is None else row_max_b[r], n_b, ctx.tiles, ctx.reduce_sum, live_b[r])
                accumulate(grad_value, weights.t(), grad_out_b[r])
                del weights
                accumulate(grad_key, grad_scores.t(), x_r)
                accumulate(grad_x_block, grad_scores, key)
                del grad_scores
            if grad_x_block.dtype != x.dtype:
                grad_x_r.copy_(grad_x_block)
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
