"""Flash Pattention as Triton kernels, for the l2 Θ: the [tokens × n] scores exist only tile by tile on the chip.

A program owns a tile of input rows (or of parameter tokens) and sweeps the other axis, recomputing each score
tile A = τX·Kᵀ (and, in backward, dW = dY·Vᵀ) from the inputs, rounded to the input dtype as the other
implementations keep them; Θ's formulas are fused.py's, its elementwise math tiles_triton.py's. Per call and
Pattention, five launches whatever the token count, the row statistics reduced over the tensor-parallel ranks
(`reduce_sum`, one all-reduce of all the call's Pattentions) between them:

    forward   1  s = Σ a² (l2_norm_gelu) or Σ GeLU(a)² (gelu_l2_norm) per row          grid: row tiles
              2  Y = Θ(A)·V, the row factor r = √N/√s written beside it          grid: row tiles × d_out tiles
    backward  3  c = Σ (Θ's gradient term) per row (fused.py's c)                      grid: row tiles
              4  dX = τ·dA·K, summed over the call's Pattentions in at least fp32  grid: row tiles × d_in tiles
              5  dK = dAᵀ·(τX), dV = W'ᵀ·dY                                grid: token tiles × width tiles

Each product's sum runs inside one program in a fixed order, with no atomics: the results are deterministic,
and appending zero-key tokens (growth) leaves the old tokens' tiles, and so their gradients, as they were.
Kept for backward: τX, s and r (fp32; fp64 for fp64 inputs) and the parameters; nothing grows with n.

The price is recomputation: a program's output tile is at most BLOCK_D wide, so a width of d recomputes its
score tiles ceil(d / BLOCK_D) times (R). In GEMMs of [tokens × n × d]: forward 2 + R, backward 2 + (2R + 1) +
(2R + 2), against the fused node's 6 (docs/performance.md works the floor out).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron.model.pattention import tiles_triton  # first: switches on Triton's interpreter where there is no GPU
from megatron.model.pattention.registry import FLASH_KERNEL_THETAS as THETAS
from megatron.model.pattention.theta import ZERO_ROW_GUARD, Reduce, check_theta, identity

import triton  # isort: skip
import triton.language as tl  # isort: skip
from triton.runtime.interpreter import InterpretedFunction  # isort: skip

_L2_NORM_GELU, _GELU_L2_NORM = tl.constexpr(0), tl.constexpr(1)
_GUARD = tl.constexpr(ZERO_ROW_GUARD)
# Triton's interpreter multiplies bf16 operands of tl.dot as their raw 16-bit patterns, and casts fp32 to bf16 by
# truncation: there the operands are upcast first (a GPU's bf16 dot sums exact products in fp32), and values are
# rounded to the nearest even bf16 before the cast, as a GPU's cast rounds.
INTERPRETED = isinstance(tl.zeros, InterpretedFunction)
_INTERPRETED = tl.constexpr(INTERPRETED)


def _helper(fn):
    """A function the kernels call: a Triton function; under the interpreter the plain Python one, which runs
    in the kernel's already patched triton.language (an interpreted Triton function patches it again on every
    call, at more cost than most helpers' work)."""
    return fn if INTERPRETED else triton.jit(fn)


_cdf, _gelu_grad = (f.fn if INTERPRETED else f for f in (tiles_triton._cdf, tiles_triton._gelu_grad))


@dataclass(frozen=True)
class Tiles:
    """Tile sizes: rows (M) and parameter tokens (N) of a score tile, the reduction step over a width (K), an
    output tile's width (D); and the launch's warps and pipeline stages (ignored by the interpreter)."""

    m: int
    n: int
    k: int
    d: int
    warps: int = 4
    stages: int = 2

    def launch(self) -> dict:
        """The launch arguments every kernel takes (the output width D aside)."""
        return {"BM": self.m, "BN": self.n, "BK": self.k, "num_warps": self.warps, "num_stages": self.stages}


# By device type. On a GPU the accumulators [M, D] (forward, dX) and two [N, D] (dK, dV) live in registers; D
# sets the recomputation (above): the widest D whose five kernels compile for sm_90 in bf16 without spilling
# (benchmarks/flash_kernels_compile.py; a narrower reduction step K leaves the registers to the accumulators).
# The interpreter runs every program's every operation in Python, at about the same cost whatever the tile's
# size: large tiles make few of them.
TILES = {"cpu": Tiles(64, 64, 64, 64), "default": Tiles(64, 32, 32, 256, warps=8, stages=2)}


def tiles_for(device: torch.device) -> Tiles:
    return TILES.get(device.type, TILES["default"])


@_helper
def _rounded(x, dtype: tl.constexpr):
    """x in `dtype`, rounded to nearest even."""
    if _INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@_helper
def _dot(a, b, acc, ACC: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a·b in ACC."""
    if _INTERPRETED:
        a, b = a.to(ACC), b.to(ACC)
    return tl.dot(a, b, acc, input_precision=PRECISION, out_dtype=ACC)


@_helper
def _product(a_ptr, b_ptr, rows, cols, R, C, W, BK: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr):
    """A[rows]·B[cols]ᵀ for row-major A [R, W] and B [C, W], accumulated in ACC and rounded to their dtype, as
    torch.mm's result is (masked rows and columns give 0)."""
    result = tl.zeros((rows.shape[0], cols.shape[0]), ACC)
    a_rows, a_mask = a_ptr + rows[:, None] * W, rows[:, None] < R
    b_cols, b_mask = b_ptr + cols[None, :] * W, cols[None, :] < C
    for start in range(0, W, BK):
        ks = start + tl.arange(0, BK)
        a = tl.load(a_rows + ks[None, :], mask=a_mask & (ks[None, :] < W), other=0.0)
        b = tl.load(b_cols + ks[:, None], mask=b_mask & (ks[:, None] < W), other=0.0)
        if _INTERPRETED:  # _dot's cast, here inline: the interpreter's every jit call costs more than a dot
            a, b = a.to(ACC), b.to(ACC)
        result = tl.dot(a, b, result, input_precision=PRECISION, out_dtype=ACC)
    if a_ptr.dtype.element_ty != ACC:  # fp32 and fp64 need no rounding (nor, interpreted, the call)
        result = _rounded(result, a_ptr.dtype.element_ty).to(ACC)
    return result


@_helper
def _coefficient(s, c, count, THETA: tl.constexpr):
    """The backward's row coefficient from s and the reduced c (0 where s is below the guard): c/N for
    l2_norm_gelu, c/s for gelu_l2_norm (fused.py)."""
    live = s > _GUARD
    if THETA == _L2_NORM_GELU:
        coefficient = tl.where(live, c / count, 0.0)
    else:
        coefficient = tl.where(live, c / tl.maximum(s, _GUARD), 0.0)
    return coefficient


@_helper
def _gradient(a, grad_w, row, coefficient, THETA: tl.constexpr):
    """(W', dA) of a score tile a and its dW (tiles_torch.py's l2_norm_gelu_gradient, gelu_l2_norm_backward):
    W' the weights with their row factor, dV = W'ᵀ·dY."""
    scaled = grad_w * row[:, None]
    if THETA == _L2_NORM_GELU:
        z = a * row[:, None]
        cdf = _cdf(z)
        weights = z * cdf
        grad_a = _gelu_grad(z, cdf) * scaled - coefficient[:, None] * z
    else:
        cdf = _cdf(a)
        g = a * cdf
        weights = g * row[:, None]
        grad_a = _gelu_grad(a, cdf) * (scaled - coefficient[:, None] * g)
    return weights, grad_a


@triton.jit
def _statistics_kernel(x_ptr, k_ptr, s_ptr, M, N, DI, THETA: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    total = tl.zeros((BM,), ACC)
    for start in range(0, N, BN):
        a = _product(x_ptr, k_ptr, rows, start + tl.arange(0, BN), M, N, DI, BK, ACC, PRECISION)
        if THETA == _GELU_L2_NORM:
            a = a * _cdf(a)  # GeLU(0) = 0: masked entries add nothing
        total += tl.sum(a * a, axis=1)
    tl.store(s_ptr + rows, total, mask=rows < M)


@triton.jit
def _output_kernel(x_ptr, k_ptr, v_ptr, s_ptr, count_ptr, r_ptr, y_ptr, M, N, DI, DO, THETA: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr,
                   PRECISION: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    outs = tl.program_id(1) * BD + tl.arange(0, BD)
    s = tl.load(s_ptr + rows, mask=rows < M, other=0.0)
    row = tl.math.rsqrt(tl.maximum(s, _GUARD)) * tl.sqrt(tl.load(count_ptr))
    if tl.program_id(1) == 0:
        tl.store(r_ptr + rows, row, mask=rows < M)
    out = tl.zeros((BM, BD), ACC)
    for start in range(0, N, BN):
        cols = start + tl.arange(0, BN)
        a = _product(x_ptr, k_ptr, rows, cols, M, N, DI, BK, ACC, PRECISION)
        if THETA == _L2_NORM_GELU:
            a = a * row[:, None]
        weights = _rounded(a * _cdf(a), v_ptr.dtype.element_ty)
        v = tl.load(v_ptr + cols[:, None] * DO + outs[None, :], mask=(cols[:, None] < N) & (outs[None, :] < DO),
                    other=0.0)
        out = _dot(weights, v, out, ACC, PRECISION)
    if THETA == _GELU_L2_NORM:
        out = out * row[:, None]
    tl.store(y_ptr + rows[:, None] * DO + outs[None, :], _rounded(out, y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (outs[None, :] < DO))


@triton.jit
def _row_dot_kernel(x_ptr, k_ptr, v_ptr, dy_ptr, r_ptr, c_ptr, M, N, DI, DO, THETA: tl.constexpr, BM: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    row = tl.load(r_ptr + rows, mask=rows < M, other=0.0)[:, None]
    c = tl.zeros((BM,), ACC)
    for start in range(0, N, BN):
        cols = start + tl.arange(0, BN)
        a = _product(x_ptr, k_ptr, rows, cols, M, N, DI, BK, ACC, PRECISION)
        scaled = _product(dy_ptr, v_ptr, rows, cols, M, N, DO, BK, ACC, PRECISION) * row
        if THETA == _L2_NORM_GELU:
            z = a * row
            term = _gelu_grad(z, _cdf(z)) * scaled * z
        else:
            term = scaled * a * _cdf(a)
        c += tl.sum(term, axis=1)
    tl.store(c_ptr + rows, c, mask=rows < M)


@triton.jit
def _input_gradient_kernel(x_ptr, k_ptr, v_ptr, dy_ptr, s_ptr, r_ptr, c_ptr, count_ptr, sum_ptr, dx_ptr, scale, M, N,
                           DI, DO, THETA: tl.constexpr, ACCUMULATE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                           BK: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    ins = tl.program_id(1) * BD + tl.arange(0, BD)
    s = tl.load(s_ptr + rows, mask=rows < M, other=0.0)
    row = tl.load(r_ptr + rows, mask=rows < M, other=0.0)
    coefficient = _coefficient(s, tl.load(c_ptr + rows, mask=rows < M, other=0.0), tl.load(count_ptr), THETA)
    grad_x = tl.zeros((BM, BD), ACC)
    for start in range(0, N, BN):
        cols = start + tl.arange(0, BN)
        a = _product(x_ptr, k_ptr, rows, cols, M, N, DI, BK, ACC, PRECISION)
        grad_w = _product(dy_ptr, v_ptr, rows, cols, M, N, DO, BK, ACC, PRECISION)
        _, grad_a = _gradient(a, grad_w, row, coefficient, THETA)
        k = tl.load(k_ptr + cols[:, None] * DI + ins[None, :], mask=(cols[:, None] < N) & (ins[None, :] < DI),
                    other=0.0)
        grad_x = _dot(_rounded(grad_a, k_ptr.dtype.element_ty), k, grad_x, ACC, PRECISION)
    offsets = rows[:, None] * DI + ins[None, :]
    mask = (rows[:, None] < M) & (ins[None, :] < DI)
    grad_x = grad_x * scale
    if ACCUMULATE:
        grad_x += tl.load(sum_ptr + offsets, mask=mask, other=0.0).to(ACC)
    tl.store(dx_ptr + offsets, _rounded(grad_x, dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _token_gradient_kernel(x_ptr, k_ptr, v_ptr, dy_ptr, s_ptr, r_ptr, c_ptr, count_ptr, dk_ptr, dv_ptr, M, N, DI, DO,
                           THETA: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                           BD: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr):
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    width = tl.program_id(1) * BD + tl.arange(0, BD)
    count = tl.load(count_ptr)
    grad_k = tl.zeros((BN, BD), ACC)
    grad_v = tl.zeros((BN, BD), ACC)
    for start in range(0, M, BM):
        rows = start + tl.arange(0, BM)
        s = tl.load(s_ptr + rows, mask=rows < M, other=0.0)
        row = tl.load(r_ptr + rows, mask=rows < M, other=0.0)
        coefficient = _coefficient(s, tl.load(c_ptr + rows, mask=rows < M, other=0.0), count, THETA)
        a = _product(x_ptr, k_ptr, rows, cols, M, N, DI, BK, ACC, PRECISION)
        grad_w = _product(dy_ptr, v_ptr, rows, cols, M, N, DO, BK, ACC, PRECISION)
        weights, grad_a = _gradient(a, grad_w, row, coefficient, THETA)
        x = tl.load(x_ptr + rows[:, None] * DI + width[None, :], mask=(rows[:, None] < M) & (width[None, :] < DI),
                    other=0.0)
        grad_k = _dot(tl.trans(_rounded(grad_a, x_ptr.dtype.element_ty)), x, grad_k, ACC, PRECISION)
        dy = tl.load(dy_ptr + rows[:, None] * DO + width[None, :], mask=(rows[:, None] < M) & (width[None, :] < DO),
                     other=0.0)
        grad_v = _dot(tl.trans(_rounded(weights, dy_ptr.dtype.element_ty)), dy, grad_v, ACC, PRECISION)
    tl.store(dk_ptr + cols[:, None] * DI + width[None, :], _rounded(grad_k, dk_ptr.dtype.element_ty),
             mask=(cols[:, None] < N) & (width[None, :] < DI))
    tl.store(dv_ptr + cols[:, None] * DO + width[None, :], _rounded(grad_v, dv_ptr.dtype.element_ty),
             mask=(cols[:, None] < N) & (width[None, :] < DO))


def _settings(x: Tensor, theta: str) -> dict:
    """The constexpr arguments every kernel takes for input x and Θ."""
    accumulate = tl.float64 if x.dtype == torch.float64 else tl.float32
    tf32 = x.dtype == torch.float32 and x.is_cuda and torch.backends.cuda.matmul.allow_tf32
    return {"THETA": THETAS.index(theta), "ACC": accumulate, "PRECISION": "tf32" if tf32 else "ieee"}


class _FlashKernels(torch.autograd.Function):
    """x [tokens, d_in], B keys [n, d_in], B values [n, d_out], token counts n [B] -> Y [B, tokens, d_out];
    the contract of fused.py's _FusedPattention, for the l2 Θ. Backward computes only the gradients asked for
    (frozen tokens get none)."""

    @staticmethod
    def forward(ctx, x, theta, tau, n, reduce_sum, *tokens):
        if tau != 1.0:
            x = x * tau
        x, *tokens = (t.contiguous() for t in (x, *tokens))
        keys, values = tokens[:len(tokens) // 2], tokens[len(tokens) // 2:]
        n = n.to(torch.promote_types(x.dtype, torch.float32))
        tiles, settings = tiles_for(x.device), _settings(x, theta)
        (m, d_in), d_out = x.shape, values[0].shape[1]
        statistics = x.new_empty(len(keys), m, dtype=n.dtype)
        for key, s in zip(keys, statistics):
            _statistics_kernel[(triton.cdiv(m, tiles.m),)](x, key, s, m, len(key), d_in, **settings, **tiles.launch())
        statistics = reduce_sum(statistics)
        rows, out = torch.empty_like(statistics), x.new_empty(len(keys), m, d_out)
        grid = (triton.cdiv(m, tiles.m), triton.cdiv(d_out, tiles.d))
        for b, (key, value) in enumerate(zip(keys, values)):
            _output_kernel[grid](x, key, value, statistics[b], n[b:], rows[b], out[b], m, len(key), d_in, d_out,
                                 **settings, **tiles.launch(), BD=tiles.d)
        ctx.save_for_backward(x, statistics, rows, n, *tokens)
        ctx.theta, ctx.tau, ctx.reduce_sum = theta, tau, reduce_sum
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, statistics, rows, n, *tokens = ctx.saved_tensors
        keys, values = tokens[:len(tokens) // 2], tokens[len(tokens) // 2:]
        grad_out = grad_out.contiguous()
        tiles, settings = tiles_for(x.device), _settings(x, ctx.theta)
        (m, d_in), d_out = x.shape, values[0].shape[1]
        c = torch.empty_like(statistics)
        for b, (key, value) in enumerate(zip(keys, values)):
            _row_dot_kernel[(triton.cdiv(m, tiles.m),)](x, key, value, grad_out[b], rows[b], c[b], m, len(key), d_in,
                                                        d_out, **settings, **tiles.launch())
        c = ctx.reduce_sum(c)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.empty_like(x)
            # dX of several Pattentions is summed in at least fp32, the last one's kernel writing x's dtype
            partial = grad_x if len(keys) == 1 or x.dtype == c.dtype else x.new_empty(m, d_in, dtype=c.dtype)
            grid = (triton.cdiv(m, tiles.m), triton.cdiv(d_in, tiles.d))
            for b, (key, value) in enumerate(zip(keys, values)):
                _input_gradient_kernel[grid](x, key, value, grad_out[b], statistics[b], rows[b], c[b], n[b:], partial,
                                             grad_x if b == len(keys) - 1 else partial, ctx.tau, m, len(key), d_in,
                                             d_out, **settings, ACCUMULATE=b > 0, **tiles.launch(), BD=tiles.d)
        grad_tokens = [None] * len(tokens)
        for b, (key, value) in enumerate(zip(keys, values)):
            if ctx.needs_input_grad[5 + b] or ctx.needs_input_grad[5 + len(keys) + b]:
                grad_tokens[b], grad_tokens[len(keys) + b] = torch.empty_like(key), torch.empty_like(value)
                grid = (triton.cdiv(len(key), tiles.n), triton.cdiv(max(d_in, d_out), tiles.d))
                _token_gradient_kernel[grid](x, key, value, grad_out[b], statistics[b], rows[b], c[b], n[b:],
                                             grad_tokens[b], grad_tokens[len(keys) + b], m, len(key), d_in, d_out,
                                             **settings, **tiles.launch(), BD=tiles.d)
        return grad_x, None, None, None, None, *grad_tokens


def flash_kernel_pattentions(
    x: Tensor,
    key_tokens: Sequence[Tensor],
    value_tokens: Sequence[Tensor],
    theta: str,
    tau: float,
    norm_token_counts: Sequence[int | Tensor],
    reduce_sum: Reduce = identity,
    reduce_max: Reduce = identity,
) -> Tensor:
    """`fused_pattentions`' contract ([B, ..., d_out]) by the kernels above; Θ one of THETAS (`reduce_max`,
    which only softmax needs, is not called)."""
    check_theta(theta)
    if theta not in THETAS:
        raise ValueError(f"the flash kernels compute {' and '.join(THETAS)}, not {theta!r}: flash.py's blocks of "
                         "rows compute every Θ")
    counts = torch.stack([torch.as_tensor(n, device=x.device) for n in norm_token_counts])
    out = _FlashKernels.apply(x.reshape(-1, x.shape[-1]), theta, float(tau), counts, reduce_sum, *key_tokens,
                              *value_tokens)
    return out.view(len(key_tokens), *x.shape[:-1], value_tokens[0].shape[-1])
