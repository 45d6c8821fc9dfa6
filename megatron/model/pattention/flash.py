"""Flash Pattention: Θ(τ·X·K_Pᵀ)·V_P without ever holding the [tokens × n] score matrix.

As FlashAttention does for softmax attention, the parameter tokens are visited in tiles of KEY_TILE (and
the input rows in blocks), each tile's scores are made, used and dropped, and backward recomputes them
from the saved input. What one Pattention keeps for backward is its input and O(tokens) row statistics
(gelu_l2_norm and softmax: also their output), whatever n is. Per Θ (notation of fused.py's
node: N the layer's token count, s the row statistic over all N tokens, r = √N/√s, c a row reduction):

    l2_norm_gelu   s = ‖τ·x·K_Pᵀ‖² = τ²·x·(K_PᵀK_P)·xᵀ: a d × d Gram matrix, no scores; then one pass,
                   Y = Σ_j GeLU(r·A_j)·V_j. Backward, one pass: D_j = GeLU'(Z_j)·r·dW_j gives dV_j, and dK_j,
                   dX from D as if it were dA, and c = Σ D·Z; then dA = D − (c/N)·Z, whose second term is
                   linear in A = X·K_Pᵀ, is applied once: dK −= K_P·Xᵀ·diag(c·r/N)·X, dX −= diag(c·r/N)·X·K_PᵀK_P.
    gelu_l2_norm   one pass: Y' = Σ_j GeLU(A_j)·V_j and s = Σ_j ΣGeLU(A_j)²; Y = r·Y'.
    softmax        one pass, online: running max m, Σexp(A − m), accumulator rescaled when m grows;
                   Y = N/s·Y'.  For both, backward's c = dY·Y: the output is kept.

Backward is one pass over the tiles: recompute A_j, dW_j = dY·V_jᵀ, Θ's closed-form gradient
(tiles_torch.py), then dV_j, dK_j and dX: five GEMMs a tile, one more than the fused node's four.
Under tensor parallelism each rank tiles its own block of tokens; the statistics go through
`reduce_sum` / `reduce_max` as in the fused node: s (and the row max) in forward, c in backward. The
Gram matrix is summed over this rank's tokens only, like s.

The elementwise work on each tile runs in a tile backend the caller passes (`tiles`): tiles_torch.py
(PyTorch) or tiles_triton.py (Triton kernels), chosen by name in registry.py (Triton on CUDA by default;
anywhere under Triton's interpreter when asked). KEY_TILE is fixed per device type, not derived from n, so that
growth (zero keys appended after the old tokens) leaves every old tile's computation as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch
from torch import Tensor

from megatron.model.pattention import tiles_torch
from megatron.model.pattention.theta import ZERO_ROW_GUARD, Reduce, at_least_fp32, check_theta, identity, row_dot

# Parameter tokens a tile, by device type. On a GPU each key tile adds its product into the fp32 accumulators of
# the output and of dX (a read and a write of [rows, d] fp32) and costs a few kernel launches: fewer, wider
# tiles there (on an H200, 512-token tiles left flash waiting on launches and accumulator traffic).
KEY_TILE = {"cpu": 512, "default": 2048}
# Elements of one [rows, key tile] tile buffer: small enough that the few alive at once stay far below a
# [tokens, n] score matrix, large enough for efficient GEMMs (a GPU wants larger ones than a CPU).
TILE_ELEMENTS = {"cpu": 2**17, "default": 2**23}


def _for_device(table: dict[str, int], device: torch.device) -> int:
    return table.get(device.type, table["default"])


def _row_blocks(tokens: int, device: torch.device) -> list[slice]:
    rows = max(1, _for_device(TILE_ELEMENTS, device) // _for_device(KEY_TILE, device))
    return [slice(start, min(start + rows, tokens)) for start in range(0, tokens, rows)]


def _key_tiles(count: int, device: torch.device) -> list[slice]:
    tile = _for_device(KEY_TILE, device)
    return [slice(start, min(start + tile, count)) for start in range(0, count, tile)]


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


def accumulate(target: Tensor, a: Tensor, b: Tensor, alpha: float = 1) -> None:
    """target += alpha·a·b, target in at least fp32 (a and b may be bf16/fp16): where torch offers it, the product
    comes out in fp32 too, instead of each tile's product being rounded to bf16 before the sum."""
    if target.dtype == a.dtype:
        target.addmm_(a, b, alpha=alpha)
    elif target.is_contiguous() and _wide_output_addmm(a.device, a.dtype):
        torch.addmm(target, a, b, out_dtype=target.dtype, alpha=alpha, out=target)
    elif wide_output_matmul(a.device, a.dtype):
        target.add_(torch.mm(a, b, out_dtype=target.dtype), alpha=alpha)
    else:
        target.add_(torch.mm(a, b), alpha=alpha)


def _split_bf16(t: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 t as hi + lo, both bf16: their sum is t to about 2⁻¹⁷ relative (fp32: 2⁻²⁴; bf16 alone: 2⁻⁹)."""
    hi = t.to(torch.bfloat16)
    return hi, (t - hi.float()).to(torch.bfloat16)


def mixed_addmm(target: Tensor, a: Tensor, b: Tensor, alpha: float = 1) -> None:
    """target += alpha·a·b to fp32 accuracy, target in at least fp32, where a or b holds the activations' values
    (bf16 in a bf16 model) and the other is an fp32 statistic (a Gram matrix, a moment, row-scaled inputs).
    Where torch multiplies bf16 into fp32, the fp32 operand goes in as hi + lo (_split_bf16): two bf16 GEMMs on
    the tensor cores instead of one fp32 GEMM that runs an order of magnitude slower (on an H200, the d × d terms
    in fp32 took half of flash's time). Elsewhere, and for fp32/fp64 models, one GEMM in at least fp32."""
    narrow = a if a.dtype == torch.bfloat16 else b if b.dtype == torch.bfloat16 else None
    if narrow is None or target.dtype != torch.float32 or not wide_output_matmul(narrow.device, narrow.dtype):
        target.addmm_(at_least_fp32(a), at_least_fp32(b), alpha=alpha)
        return
    if a.dtype == b.dtype:
        accumulate(target, a, b, alpha)
        return
    for part in _split_bf16(b if narrow is a else a.float()):
        accumulate(target, *((a, part) if narrow is a else (part, b)), alpha)


def _gram(key: Tensor) -> Tensor:
    """K_Pᵀ·K_P [d_in, d_in] in at least fp32: ‖x·K_Pᵀ‖² = x·(K_PᵀK_P)·xᵀ without the scores. Summed tile by
    tile, so that appended zero keys (growth) add exact zeros to the old tiles' sum. A bf16 key's products are
    exact in fp32: where torch multiplies bf16 into fp32, the key stays bf16 (tensor cores)."""
    if not (key.dtype == torch.bfloat16 and wide_output_matmul(key.device, key.dtype)):
        key = at_least_fp32(key)
    gram = torch.zeros(key.shape[1], key.shape[1], dtype=torch.promote_types(key.dtype, torch.float32),
                       device=key.device)
    for j in _key_tiles(len(key), key.device):
        accumulate(gram, key[j].t(), key[j])
    return gram


def _times_gram(x: Tensor, gram: Tensor) -> Tensor:
    """x·(K_PᵀK_P) in at least fp32."""
    product = torch.zeros(len(x), gram.shape[1], dtype=gram.dtype, device=x.device)
    mixed_addmm(product, x, gram)
    return product


def _forward_one(x: Tensor, key: Tensor, value: Tensor, n: Tensor, theta: str, tiles: ModuleType,
                 reduce_sum: Reduce, reduce_max: Reduce, out: Tensor) -> dict[str, Tensor]:
    """One Pattention of x (τ applied) accumulated into `out` (zeros, at least fp32): what backward needs,
    by the passes above."""
    acc_dtype = out.dtype
    rows, keys = _row_blocks(len(x), x.device), _key_tiles(len(key), x.device)
    if theta == "l2_norm_gelu":
        gram = _gram(key)
        statistic = torch.empty(len(x), 1, dtype=acc_dtype, device=x.device)
        for r in rows:
            statistic[r] = row_dot(_times_gram(x[r], gram), x[r])
        statistic = reduce_sum(statistic)
        del gram
        row = torch.rsqrt(statistic.clamp(min=ZERO_ROW_GUARD)).mul_(n.sqrt())
        for r in rows:
            for j in keys:
                weights = tiles.l2_norm_gelu_forward(torch.mm(x[r], key[j].t()), row[r])
                accumulate(out[r], weights, value[j])
                del weights  # before the next tile's buffers exist
        return {"statistic": statistic, "row": row}
    statistic = torch.zeros(len(x), 1, dtype=acc_dtype, device=x.device)
    if theta == "gelu_l2_norm":
        for r in rows:
            for j in keys:
                weights, sum_sq = tiles.gelu_l2_norm_forward(torch.mm(x[r], key[j].t()))
                accumulate(out[r], weights, value[j])
                statistic[r] += sum_sq
                del weights
        statistic = reduce_sum(statistic)
        row = torch.rsqrt(statistic.clamp(min=ZERO_ROW_GUARD)).mul_(n.sqrt())
        out.mul_(row)
        return {"statistic": statistic, "row": row}
    row_max = torch.full((len(x), 1), -torch.inf, dtype=acc_dtype, device=x.device)
    for r in rows:
        for j in keys:
            previous = row_max[r].clone()
            e, e_sum, row_max[r] = tiles.softmax_forward(torch.mm(x[r], key[j].t()), previous)
            rescale = torch.exp(previous - row_max[r])
            out[r].mul_(rescale)
            statistic[r].mul_(rescale).add_(e_sum)
            accumulate(out[r], e, value[j])
            del e
    shared_max = reduce_max(row_max)
    rescale = torch.exp(row_max - shared_max)
    statistic = reduce_sum(statistic.mul_(rescale))
    row = n / statistic
    out.mul_(rescale * row)
    return {"statistic": statistic, "row": row, "row_max": shared_max}


def _backward_one(x: Tensor, key: Tensor, value: Tensor, n: Tensor, grad_out: Tensor, theta: str,
                  tiles: ModuleType, saved: dict[str, Tensor], grad_x: Tensor, reduce_sum: Reduce
                  ) -> tuple[Tensor, Tensor]:
    """(dK, dV) of one Pattention; dX (τ not applied) added into grad_x (at least fp32)."""
    statistic, row = saved["statistic"], saved["row"]
    live = (statistic > ZERO_ROW_GUARD).to(statistic.dtype)
    acc_dtype = torch.promote_types(x.dtype, torch.float32)
    if theta == "gelu_l2_norm":
        coef = reduce_sum(row_dot(grad_out, saved["out"])).mul_(live).div_(statistic.clamp(min=ZERO_ROW_GUARD))
    elif theta == "softmax":
        coef = reduce_sum(row_dot(grad_out, saved["out"])).mul_(row).div_(n)
    else:
        dot = torch.zeros(len(x), 1, dtype=acc_dtype, device=x.device)
    grad_key = torch.zeros(key.shape, dtype=acc_dtype, device=x.device)
    grad_value = torch.zeros(value.shape, dtype=acc_dtype, device=x.device)
    rows = _row_blocks(len(x), x.device)
    for r in rows:
        for j in _key_tiles(len(key), key.device):
            a = torch.mm(x[r], key[j].t())
            grad_w = torch.mm(grad_out[r], value[j].t())
            if theta == "l2_norm_gelu":
                weights, grad_a, dot_tile = tiles.l2_norm_gelu_backward(a, grad_w, row[r])
                dot[r] += dot_tile
            elif theta == "gelu_l2_norm":
                weights, grad_a = tiles.gelu_l2_norm_backward(a, grad_w, row[r], coef[r])
            else:
                weights, grad_a = tiles.softmax_backward(a, grad_w, saved["row_max"][r], row[r], coef[r])
            del a, grad_w
            accumulate(grad_value[j], weights.t(), grad_out[r])
            accumulate(grad_key[j], grad_a.t(), x[r])
            accumulate(grad_x[r], grad_a, key[j])
            del weights, grad_a
    if theta == "l2_norm_gelu":
        # dA = D − k·r·A with k = c·live/N, c = Σ over all tokens of D·Z: the second term, linear in A = X·K_Pᵀ,
        # is applied once for all tiles: dK −= K_P·(Xᵀ·diag(k·r)·X), dX −= diag(k·r)·X·(K_PᵀK_P).
        # One d × d matrix alive at a time.
        scale = reduce_sum(dot).mul_(live).div_(n).mul_(row)
        gram = _gram(key)
        for r in rows:
            grad_x[r].sub_(_times_gram(x[r], gram).mul_(scale[r]))
        moment = gram.zero_()
        for r in rows:
            mixed_addmm(moment, (at_least_fp32(x[r]) * scale[r]).t(), x[r])
        mixed_addmm(grad_key, key, moment, alpha=-1)
    return grad_key.to(key.dtype), grad_value.to(value.dtype)


class _FlashPattention(torch.autograd.Function):
    """x [tokens, d_in], B keys [n, d_in], B values [n, d_out], token counts n [B] -> Y [B, tokens, d_out];
    the contract of fused.py's _FusedPattention, by the tiled passes above."""

    @staticmethod
    def forward(ctx, x, theta, tau, n, reduce_sum, reduce_max, tiles, *tokens):
        keys, values = tokens[:len(tokens) // 2], tokens[len(tokens) // 2:]
        if tau != 1.0:
            x = x * tau
        n = n.to(torch.promote_types(x.dtype, torch.float32))
        out = x.new_empty(len(keys), len(x), values[0].shape[1])
        kept = []
        acc_dtype = torch.promote_types(x.dtype, torch.float32)
        for b, (key, value) in enumerate(zip(keys, values)):
            acc = out[b].zero_() if acc_dtype == x.dtype else out.new_zeros(out.shape[1:], dtype=acc_dtype)
            kept.append(_forward_one(x, key, value, n[b], theta, tiles, reduce_sum, reduce_max, acc))
            if acc_dtype != x.dtype:
                out[b].copy_(acc)
        names = [sorted(k) for k in kept]
        ctx.save_for_backward(x, n, out if theta != "l2_norm_gelu" else None, *tokens,
                              *(k[name] for k, kn in zip(kept, names) for name in kn))
        ctx.names, ctx.theta, ctx.tau, ctx.reduce_sum, ctx.tiles = names, theta, tau, reduce_sum, tiles
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, n, out, *rest = ctx.saved_tensors
        count = len(ctx.names)
        keys, values, statistics = rest[:count], rest[count:2 * count], iter(rest[2 * count:])
        grad_out = grad_out.contiguous()
        grad_x = torch.zeros_like(x, dtype=torch.promote_types(x.dtype, torch.float32))
        grad_keys, grad_values = [], []
        for b, (key, value) in enumerate(zip(keys, values)):
            saved = {name: next(statistics) for name in ctx.names[b]}
            if out is not None:
                saved["out"] = out[b]
            grad_key, grad_value = _backward_one(x, key, value, n[b], grad_out[b], ctx.theta, ctx.tiles, saved,
                                                 grad_x, ctx.reduce_sum)
            grad_keys.append(grad_key)
            grad_values.append(grad_value)
        if ctx.tau != 1.0:
            grad_x.mul_(ctx.tau)
        return grad_x.to(x.dtype), None, None, None, None, None, None, *grad_keys, *grad_values


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
    """`fused_pattentions`' contract ([B, ..., d_out]), computed tile by tile with the tile functions of
    `tiles` (a tile backend: tiles_torch or tiles_triton; registry.py picks one by name)."""
    check_theta(theta)
    counts = torch.stack([torch.as_tensor(n, device=x.device) for n in norm_token_counts])
    out = _FlashPattention.apply(x.reshape(-1, x.shape[-1]), theta, float(tau), counts, reduce_sum, reduce_max,
                                 tiles, *key_tokens, *value_tokens)
    return out.view(len(key_tokens), *x.shape[:-1], value_tokens[0].shape[-1])
