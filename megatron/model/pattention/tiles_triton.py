"""The Triton tile backend: Θ on one tile of scores as Triton kernels, the functions of tiles_torch.py with
the same arguments and results.

tiles_torch.py gives the math and is the reference. Each PyTorch version makes several passes over the tile
(one per elementwise op, each with an [R, C] temporary); each kernel here reads a (and grad_w) once, computes
in fp32 registers and writes its results once. Elementwise functions run one program per BLOCK_R × BLOCK_C
block; those with a row reduction (gelu_l2_norm_forward's Σ G², softmax_forward's Σ E,
sum_squares and the three backward dots) run one program per ROW_BLOCK_R rows, looping over the columns.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

if not torch.cuda.is_available():
    # Without a GPU the kernels can only run under Triton's interpreter, on CPU tensors. triton.jit reads the
    # flag when it decorates a kernel, triton.language's own functions included: it must be set before the
    # first `import triton` of the process (torch._dynamo imports it too), which the entry points see to
    # (run_rank, tests/conftest.py); here is the last chance.
    os.environ["TRITON_INTERPRET"] = "1"

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

if not torch.cuda.is_available() and not isinstance(tl.zeros, InterpretedFunction):
    raise ImportError("the flash Pattention's Triton kernels need a CUDA device or Triton's interpreter, and triton "
                      "was imported before the interpreter could be switched on: start the process with "
                      "TRITON_INTERPRET=1 in its environment, or set flash_backend: pytorch")

# Elementwise kernels: 16 × 128 = 2048 elements a program (16 a thread at 4 warps); a row of 128 contiguous
# elements is a fully coalesced 512 B (fp32) / 256 B (bf16) load.
BLOCK_R = 16
BLOCK_C = 128
# Row-reduction kernels: the grid covers rows only, so few rows a program keep enough programs for the SMs
# when a tile has a few hundred rows; 256 columns a step keep 1024 elements a program.
ROW_BLOCK_R = 4
ROW_BLOCK_C = 256

# Launch arguments. FMA contraction is on, as Triton 3.9 does by default, stated so that a later default (off
# from 3.10) does not change the numerics; stating it also silences 3.9's warning. The interpreter ignores it.
_TILE = {"BR": BLOCK_R, "BC": BLOCK_C, "enable_fp_fusion": True}
_ROWS = {"BR": ROW_BLOCK_R, "BC": ROW_BLOCK_C, "enable_fp_fusion": True}

_SQRT_HALF = tl.constexpr(0.7071067811865476)  # 1/√2
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)  # 1/√(2π)


@triton.jit
def _cdf(z):
    """Φ(z), the standard normal CDF."""
    return 0.5 * (1.0 + tl.erf(z * _SQRT_HALF))


@triton.jit
def _gelu_grad(z, cdf):
    """GeLU'(z) = Φ(z) + z·φ(z), given Φ(z)."""
    return cdf + z * _INV_SQRT_2PI * tl.exp(-0.5 * z * z)


@triton.jit
def _block(R, C, BR: tl.constexpr, BC: tl.constexpr):
    """Rows [R] and columns [C] of this program's block, the offsets of its elements and their mask."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    offsets = rows[:, None] * C + cols[None, :]
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    return rows, offsets, mask


@triton.jit
def _l2_norm_gelu_forward_kernel(a_ptr, row_ptr, w_ptr, R, C, BR: tl.constexpr, BC: tl.constexpr):
    rows, offsets, mask = _block(R, C, BR, BC)
    row = tl.load(row_ptr + rows, mask=rows < R)[:, None]
    z = tl.load(a_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * row
    tl.store(w_ptr + offsets, (z * _cdf(z)).to(w_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_l2_norm_backward_kernel(a_ptr, grad_ptr, row_ptr, coef_ptr, rg_ptr, grad_a_ptr, R, C,
                                  BR: tl.constexpr, BC: tl.constexpr):
    rows, offsets, mask = _block(R, C, BR, BC)
    row = tl.load(row_ptr + rows, mask=rows < R)[:, None]
    coef = tl.load(coef_ptr + rows, mask=rows < R)[:, None]
    a = tl.load(a_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    grad_w = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    cdf = _cdf(a)
    g = a * cdf
    tl.store(rg_ptr + offsets, (g * row).to(rg_ptr.dtype.element_ty), mask=mask)
    grad_a = _gelu_grad(a, cdf) * (grad_w * row - coef * g)
    tl.store(grad_a_ptr + offsets, grad_a.to(grad_a_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_backward_kernel(a_ptr, grad_ptr, max_ptr, q_ptr, coef_ptr, qe_ptr, grad_a_ptr, R, C,
                             BR: tl.constexpr, BC: tl.constexpr):
    rows, offsets, mask = _block(R, C, BR, BC)
    row_max = tl.load(max_ptr + rows, mask=rows < R)[:, None]
    q = tl.load(q_ptr + rows, mask=rows < R)[:, None]
    coef = tl.load(coef_ptr + rows, mask=rows < R)[:, None]
    a = tl.load(a_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    grad_w = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    e = tl.exp(a - row_max)
    tl.store(qe_ptr + offsets, (e * q).to(qe_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_a_ptr + offsets, ((grad_w * q - coef) * e).to(grad_a_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_l2_norm_forward_kernel(a_ptr, g_ptr, sq_ptr, R, C, BR: tl.constexpr, BC: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    sq = tl.zeros([BR], dtype=tl.float32)
    for start in range(0, C, BC):
        cols = start + tl.arange(0, BC)
        offsets = rows[:, None] * C + cols[None, :]
        mask = (rows[:, None] < R) & (cols[None, :] < C)
        a = tl.load(a_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        g = a * _cdf(a)  # GeLU(0) = 0: masked entries add nothing to Σ G²
        tl.store(g_ptr + offsets, g.to(g_ptr.dtype.element_ty), mask=mask)
        sq += tl.sum(g * g, axis=1)
    tl.store(sq_ptr + rows, sq, mask=rows < R)


@triton.jit
def _softmax_forward_kernel(a_ptr, max_ptr, e_ptr, sum_ptr, R, C, BR: tl.constexpr, BC: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    row_max = tl.load(max_ptr + rows, mask=rows < R, other=0.0)[:, None]
    total = tl.zeros([BR], dtype=tl.float32)
    for start in range(0, C, BC):
        cols = start + tl.arange(0, BC)
        offsets = rows[:, None] * C + cols[None, :]
        mask = (rows[:, None] < R) & (cols[None, :] < C)
        a = tl.load(a_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        e = tl.where(mask, tl.exp(a - row_max), 0.0)  # a masked entry adds nothing to Σ E
        tl.store(e_ptr + offsets, e.to(e_ptr.dtype.element_ty), mask=mask)
        total += tl.sum(e, axis=1)
    tl.store(sum_ptr + rows, total, mask=rows < R)


@triton.jit
def _sum_squares_kernel(a_ptr, sq_ptr, R, C, BR: tl.constexpr, BC: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    sq = tl.zeros([BR], dtype=tl.float32)
    for start in range(0, C, BC):
        cols = start + tl.arange(0, BC)
        mask = (rows[:, None] < R) & (cols[None, :] < C)
        a = tl.load(a_ptr + rows[:, None] * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        sq += tl.sum(a * a, axis=1)
    tl.store(sq_ptr + rows, sq, mask=rows < R)


# Θ of the backward dot kernel: the term each Θ sums along a row (tiles_torch.py's *_backward_dot).
_L2_NORM_GELU, _GELU_L2_NORM, _SOFTMAX = (tl.constexpr(i) for i in range(3))


@triton.jit
def _backward_dot_kernel(a_ptr, grad_ptr, factor_ptr, max_ptr, dot_ptr, R, C, THETA: tl.constexpr,
                         BR: tl.constexpr, BC: tl.constexpr):
    # factor: r (the l2 variants) or q (softmax); max: softmax's row max. A masked entry has grad_w = 0 and adds 0.
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    factor = tl.load(factor_ptr + rows, mask=rows < R, other=0.0)[:, None]
    row_max = tl.load(max_ptr + rows, mask=rows < R, other=0.0)[:, None]
    dot = tl.zeros([BR], dtype=tl.float32)
    for start in range(0, C, BC):
        cols = start + tl.arange(0, BC)
        offsets = rows[:, None] * C + cols[None, :]
        mask = (rows[:, None] < R) & (cols[None, :] < C)
        a = tl.load(a_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        scaled_grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * factor
        if THETA == _L2_NORM_GELU:
            z = a * factor
            term = _gelu_grad(z, _cdf(z)) * scaled_grad * z
        elif THETA == _GELU_L2_NORM:
            term = scaled_grad * a * _cdf(a)
        else:
            term = scaled_grad * tl.exp(a - row_max)
        dot += tl.sum(term, axis=1)
    tl.store(dot_ptr + rows, dot, mask=rows < R)


@triton.jit
def _l2_norm_gelu_gradient_kernel(a_ptr, grad_ptr, row_ptr, k_ptr, w_ptr, grad_a_ptr, R, C,
                                  BR: tl.constexpr, BC: tl.constexpr):
    rows, offsets, mask = _block(R, C, BR, BC)
    row = tl.load(row_ptr + rows, mask=rows < R)[:, None]
    k = tl.load(k_ptr + rows, mask=rows < R)[:, None]
    z = tl.load(a_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * row
    grad_w = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    cdf = _cdf(z)
    tl.store(w_ptr + offsets, (z * cdf).to(w_ptr.dtype.element_ty), mask=mask)
    grad_a = _gelu_grad(z, cdf) * (grad_w * row) - k * z
    tl.store(grad_a_ptr + offsets, grad_a.to(grad_a_ptr.dtype.element_ty), mask=mask)


def _grid(a: Tensor) -> tuple[int, int]:
    return triton.cdiv(a.shape[0], BLOCK_R), triton.cdiv(a.shape[1], BLOCK_C)


def _row_grid(a: Tensor) -> tuple[int]:
    return (triton.cdiv(a.shape[0], ROW_BLOCK_R),)


def _stat(a: Tensor) -> Tensor:
    """A new fp32 [R, 1] row statistic for tile a."""
    return torch.empty(a.shape[0], 1, dtype=torch.float32, device=a.device)


def l2_norm_gelu_forward(a: Tensor, row: Tensor) -> Tensor:
    a, row = a.contiguous(), row.contiguous()
    w = torch.empty_like(a)
    _l2_norm_gelu_forward_kernel[_grid(a)](a, row, w, *a.shape, **_TILE)
    return w


def gelu_l2_norm_forward(a: Tensor) -> tuple[Tensor, Tensor]:
    a = a.contiguous()
    g, sq = torch.empty_like(a), _stat(a)
    _gelu_l2_norm_forward_kernel[_row_grid(a)](a, g, sq, *a.shape, **_ROWS)
    return g, sq


def softmax_forward(a: Tensor, row_max: Tensor) -> tuple[Tensor, Tensor]:
    a, row_max = a.contiguous(), row_max.contiguous()
    e, total = torch.empty_like(a), _stat(a)
    _softmax_forward_kernel[_row_grid(a)](a, row_max, e, total, *a.shape, **_ROWS)
    return e, total


def gelu_l2_norm_backward(a: Tensor, grad_w: Tensor, row: Tensor, coef: Tensor) -> tuple[Tensor, Tensor]:
    a, grad_w, row, coef = a.contiguous(), grad_w.contiguous(), row.contiguous(), coef.contiguous()
    rg, grad_a = torch.empty_like(a), torch.empty_like(a)
    _gelu_l2_norm_backward_kernel[_grid(a)](a, grad_w, row, coef, rg, grad_a, *a.shape, **_TILE)
    return rg, grad_a


def softmax_backward(a: Tensor, grad_w: Tensor, row_max: Tensor, q: Tensor, coef: Tensor) -> tuple[Tensor, Tensor]:
    a, grad_w, row_max = a.contiguous(), grad_w.contiguous(), row_max.contiguous()
    q, coef = q.contiguous(), coef.contiguous()
    qe, grad_a = torch.empty_like(a), torch.empty_like(a)
    _softmax_backward_kernel[_grid(a)](a, grad_w, row_max, q, coef, qe, grad_a, *a.shape, **_TILE)
    return qe, grad_a


def sum_squares(a: Tensor) -> Tensor:
    a = a.contiguous()
    sq = _stat(a)
    _sum_squares_kernel[_row_grid(a)](a, sq, *a.shape, **_ROWS)
    return sq


def _backward_dot(theta: tl.constexpr, a: Tensor, grad_w: Tensor, factor: Tensor, row_max: Tensor) -> Tensor:
    a, grad_w, factor, row_max = a.contiguous(), grad_w.contiguous(), factor.contiguous(), row_max.contiguous()
    dot = _stat(a)
    _backward_dot_kernel[_row_grid(a)](a, grad_w, factor, row_max, dot, *a.shape, THETA=theta.value, **_ROWS)
    return dot


def l2_norm_gelu_backward_dot(a: Tensor, grad_w: Tensor, row: Tensor) -> Tensor:
    return _backward_dot(_L2_NORM_GELU, a, grad_w, row, row)  # (no row max: any [R, 1] tensor)


def gelu_l2_norm_backward_dot(a: Tensor, grad_w: Tensor, row: Tensor) -> Tensor:
    return _backward_dot(_GELU_L2_NORM, a, grad_w, row, row)


def softmax_backward_dot(a: Tensor, grad_w: Tensor, row_max: Tensor, q: Tensor) -> Tensor:
    return _backward_dot(_SOFTMAX, a, grad_w, q, row_max)


def l2_norm_gelu_gradient(a: Tensor, grad_w: Tensor, row: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    a, grad_w, row, k = a.contiguous(), grad_w.contiguous(), row.contiguous(), k.contiguous()
    w, grad_a = torch.empty_like(a), torch.empty_like(a)
    _l2_norm_gelu_gradient_kernel[_grid(a)](a, grad_w, row, k, w, grad_a, *a.shape, **_TILE)
    return w, grad_a
