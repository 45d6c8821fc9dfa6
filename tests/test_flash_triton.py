"""The Triton tile kernels (flash_triton.py) against the PyTorch reference (flash_tiles.py).

On a machine without a GPU they run under Triton's interpreter: flash_triton sets TRITON_INTERPRET before it
imports triton, so it is imported first. Shapes are ragged against every block size (37 rows, 70 or 300
columns, a 5 × 1 tile), and 300 columns make the row-reduction kernels loop over more than one column block.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import pytest
import torch

from megatron.model.pattention import tiles_triton as flash_triton  # isort: skip  (first: sets TRITON_INTERPRET on CPU)
from megatron.model.pattention import tiles_torch as flash_tiles

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(37, 70), (5, 1), (3, 300)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Tiles in bf16/fp16 are compared with the reference run on the same inputs (fp32 inside): both round an fp32
# value, so they may differ by one unit in the last place. fp32 results are compared with a fp64 reference.
TILE_TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (1e-2, 1e-3), torch.float16: (2e-3, 1e-4)}
STAT_TOL = (1e-5, 1e-6)
# Which results are fp32 row statistics rather than tiles.
STATS = {"gelu_l2_norm_forward": {1}, "softmax_forward": {1, 2}, "l2_norm_gelu_backward": {2}}


def tile_inputs(shape: tuple[int, int], dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """A tile of scores and a gradient in `dtype`, and fp32 row statistics in realistic ranges."""
    gen = torch.Generator().manual_seed(seed)
    rows = shape[0]

    def uniform(low: float, high: float) -> torch.Tensor:
        return torch.rand(rows, 1, generator=gen) * (high - low) + low

    a = (3 * torch.randn(shape, generator=gen)).to(dtype)
    inputs = {
        "a": a,
        "grad_w": torch.randn(shape, generator=gen).to(dtype),
        "row": uniform(-1.5, 1.5).exp(),  # √N/√s > 0
        "coef": 2 * torch.randn(rows, 1, generator=gen),  # any sign
        "q": uniform(-1.0, 3.0).exp(),  # N/s > 0
        # the row max over all tiles is at least this tile's
        "row_max": a.float().amax(dim=-1, keepdim=True) + uniform(0.0, 2.0),
        # a running max from earlier tiles: above this tile's max in some rows, below in others
        "running_max": a.float().amax(dim=-1, keepdim=True) + uniform(-3.0, 3.0),
    }
    return {name: t.to(DEVICE) for name, t in inputs.items()}


@contextmanager
def guarded_allocations():
    """torch.empty/empty_like return views at the start of NaN-filled buffers; yields the guard regions after
    them, which a kernel writing past its output (a wrong row or column mask on a ragged edge) would change."""
    guards = []
    block_r = max(flash_triton.BLOCK_R, flash_triton.ROW_BLOCK_R)
    block_c = max(flash_triton.BLOCK_C, flash_triton.ROW_BLOCK_C)

    def empty(*size, dtype=None, device=None, **kwargs):
        size = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else size
        numel = math.prod(size)
        # past the end, an unmasked block of rows × columns reaches at most (block_r − 1)·C + block_c further
        buffer = torch.full((numel * (block_r + 1) + block_c,), math.nan, dtype=dtype, device=device)
        guards.append(buffer[numel:])
        return buffer[:numel].view(size)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "empty", empty)
        patch.setattr(torch, "empty_like", lambda t, **kwargs: empty(*t.shape, dtype=t.dtype, device=t.device))
        yield guards


def check(name: str, *args) -> tuple:
    """flash_triton.`name`(*args) matches flash_tiles.`name` in value, dtype and shape, and writes nothing
    outside its results; returns them."""
    a = args[0]
    with guarded_allocations() as guards:
        results = getattr(flash_triton, name)(*args)
    assert guards and all(torch.isnan(guard).all() for guard in guards), f"{name} wrote past a result"
    fp32 = a.dtype == torch.float32
    ref_args = [x.double() if fp32 and isinstance(x, torch.Tensor) else x for x in args]
    expected = getattr(flash_tiles, name)(*ref_args)
    if isinstance(expected, torch.Tensor):
        results, expected = (results,), (expected,)
    assert len(results) == len(expected)
    for i, (result, want) in enumerate(zip(results, expected)):
        if want is None:
            assert result is None, (name, i)
            continue
        is_stat = i in STATS.get(name, ())
        assert result.dtype == (torch.float32 if is_stat else a.dtype), (name, i)
        assert result.shape == ((a.shape[0], 1) if is_stat else a.shape), (name, i)
        rtol, atol = STAT_TOL if is_stat else TILE_TOL[a.dtype]
        torch.testing.assert_close(result.double(), want.double(), rtol=rtol, atol=atol,
                                   msg=lambda m, where=f"{name}[{i}]": f"{where}: {m}")
    return results


def arguments(name: str, t: dict[str, torch.Tensor]) -> tuple:
    return {
        "l2_norm_gelu_forward": (t["a"], t["row"]),
        "gelu_l2_norm_forward": (t["a"],),
        "softmax_forward": (t["a"], t["running_max"]),
        "l2_norm_gelu_backward": (t["a"], t["grad_w"], t["row"]),
        "gelu_l2_norm_backward": (t["a"], t["grad_w"], t["row"], t["coef"]),
        "softmax_backward": (t["a"], t["grad_w"], t["row_max"], t["q"], t["coef"]),
    }[name]


FUNCTIONS = ["l2_norm_gelu_forward", "gelu_l2_norm_forward", "softmax_forward",
             "l2_norm_gelu_backward", "gelu_l2_norm_backward", "softmax_backward"]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", FUNCTIONS)
def test_matches_reference(name, dtype, shape):
    check(name, *arguments(name, tile_inputs(shape, dtype)))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_forward_first_tile(dtype, shape):
    """running_max = -inf (no tile seen yet) in every row, then in every other row."""
    t = tile_inputs(shape, dtype)
    check("softmax_forward", t["a"], torch.full_like(t["running_max"], -math.inf))
    mixed = t["running_max"].clone()
    mixed[::2] = -math.inf
    _, _, new_max = check("softmax_forward", t["a"], mixed)
    assert torch.isfinite(new_max).all()
