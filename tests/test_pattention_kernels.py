"""What one Pattention implementation promises beyond the contract (tests/test_pattention_contract.py): the
Triton tile kernels (tiles_triton.py) equal the PyTorch tiles (tiles_torch.py) one by one; the fused node keeps
at most 0.6 of the plain formula's activation memory, flash keeps for backward what does not grow with n and
peaks far below fused; attention's fused path (Q, K, V in one node, heads and rotary in one node) equals the
same attention composed from plain parts, with fused and with flash Pattentions; flash's host work (the
operators it launches a call) does not grow with the token count, and at one block is about fused's.

On a machine without a GPU the kernels run under Triton's interpreter: tiles_triton sets TRITON_INTERPRET before
it imports triton, so it is imported first. Shapes are ragged against every block size (37 rows, 70 or 300
columns, a 5 × 1 tile), and 300 columns make the row-reduction kernels loop over more than one column block.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from megatron.model.pattention import tiles_triton  # isort: skip  (first: sets TRITON_INTERPRET on CPU)
from benchmarks.activation_memory import peak_activation_bytes, saved_activation_bytes
from benchmarks.pattention import aten_operators
from megatron.model.args import NORM_ACTIVATIONS, TokenFormerArgs
from megatron.model.attention import SelfAttention
from megatron.model.pattention import flash, pattention, tiles_torch
from megatron.model.pattention.flash import flash_pattentions, row_blocks
from megatron.model.pattention.fused import fused_pattention, fused_pattentions

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(37, 70), (5, 1), (3, 300)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Tiles in bf16/fp16 are compared with the reference run on the same inputs (fp32 inside): both round an fp32
# value, so they may differ by one unit in the last place. fp32 results are compared with a fp64 reference.
TILE_TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (1e-2, 1e-3), torch.float16: (2e-3, 1e-4)}
STAT_TOL = (1e-5, 1e-6)
# Which results are fp32 row statistics rather than tiles.
STATS = {"gelu_l2_norm_forward": {1}, "softmax_forward": {1}, "sum_squares": {0},
         "l2_norm_gelu_backward_dot": {0}, "gelu_l2_norm_backward_dot": {0}, "softmax_backward_dot": {0}}


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
    }
    return {name: t.to(DEVICE) for name, t in inputs.items()}


@contextmanager
def guarded_allocations():
    """torch.empty/empty_like return views at the start of NaN-filled buffers; yields the guard regions after
    them, which a kernel writing past its output (a wrong row or column mask on a ragged edge) would change."""
    guards = []
    block_r = max(tiles_triton.BLOCK_R, tiles_triton.ROW_BLOCK_R)
    block_c = max(tiles_triton.BLOCK_C, tiles_triton.ROW_BLOCK_C)

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
    """tiles_triton.`name`(*args) matches tiles_torch.`name` in value, dtype and shape, and writes nothing
    outside its results (neither backend writes to its arguments); returns them."""
    a = args[0]
    before = [x.clone() for x in args]
    with guarded_allocations() as guards:
        results = getattr(tiles_triton, name)(*args)
    assert guards and all(torch.isnan(guard).all() for guard in guards), f"{name} wrote past a result"
    fp32 = a.dtype == torch.float32
    ref_args = [x.double() if fp32 and isinstance(x, torch.Tensor) else x for x in args]
    expected = getattr(tiles_torch, name)(*args if not fp32 else ref_args)
    for arg, kept in zip(args, before):
        assert torch.equal(arg, kept), f"{name} wrote to an argument"
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
        if is_stat and name.endswith("_dot"):  # a sum of terms of either sign: error relative to the largest row
            atol = STAT_TOL[0] * want.abs().max().item()
        torch.testing.assert_close(result.double(), want.double(), rtol=rtol, atol=atol,
                                   msg=lambda m, where=f"{name}[{i}]": f"{where}: {m}")
    return results


def arguments(name: str, t: dict[str, torch.Tensor]) -> tuple:
    return {
        "l2_norm_gelu_forward": (t["a"], t["row"]),
        "gelu_l2_norm_forward": (t["a"],),
        "softmax_forward": (t["a"], t["row_max"]),
        "gelu_l2_norm_backward": (t["a"], t["grad_w"], t["row"], t["coef"]),
        "softmax_backward": (t["a"], t["grad_w"], t["row_max"], t["q"], t["coef"]),
        "sum_squares": (t["a"],),
        "l2_norm_gelu_backward_dot": (t["a"], t["grad_w"], t["row"]),
        "l2_norm_gelu_gradient": (t["a"], t["grad_w"], t["row"], t["coef"]),
        "gelu_l2_norm_backward_dot": (t["a"], t["grad_w"], t["row"]),
        "softmax_backward_dot": (t["a"], t["grad_w"], t["row_max"], t["q"]),
    }[name]


FUNCTIONS = ["l2_norm_gelu_forward", "gelu_l2_norm_forward", "softmax_forward",
             "gelu_l2_norm_backward", "softmax_backward", "sum_squares",
             "l2_norm_gelu_backward_dot", "l2_norm_gelu_gradient", "gelu_l2_norm_backward_dot", "softmax_backward_dot"]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", FUNCTIONS)
def test_matches_reference(name, dtype, shape):
    check(name, *arguments(name, tile_inputs(shape, dtype)))


# --- Memory kept for backward and at its peak -----------------------------------------------------------

@pytest.mark.parametrize("norm_type", NORM_ACTIVATIONS)
def test_fused_keeps_at_most_six_tenths_of_the_plain_activations(norm_type):
    g = torch.Generator().manual_seed(0)
    x, key, value = (torch.randn(shape, generator=g).requires_grad_() for shape in ((8, 256, 8), (512, 8), (512, 8)))

    def saved(fn):
        return saved_activation_bytes(lambda: fn(x, key, value, norm_type, 1.0, 512), exclude=(x, key, value))

    def peak(fn):
        for t in (x, key, value):
            t.grad = None
        return peak_activation_bytes(lambda: fn(x, key, value, norm_type, 1.0, 512).sum().backward(), (x, key, value))

    assert saved(fused_pattention) <= 0.6 * saved(pattention)
    assert peak(fused_pattention) <= 0.6 * peak(pattention)


@pytest.mark.parametrize("norm_type", NORM_ACTIVATIONS)
def test_flash_bytes_kept_for_backward_do_not_grow_with_n(norm_type):
    """Saved-tensor hooks count what autograd keeps (parameters and input excluded): the same at n = 256, 1024
    and 4096, and below a tenth of the fused node's at 4096."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=g).requires_grad_()

    def saved(fn, n):
        key, value = (torch.randn(n, 64, generator=g).mul_(0.1).requires_grad_() for _ in range(2))
        return saved_activation_bytes(lambda: fn(x, [key], [value], norm_type, 1.0, [n]), exclude=(x, key, value))

    kept = [saved(flash_pattentions, n) for n in (256, 1024, 4096)]
    assert kept[0] == kept[1] == kept[2]
    assert kept[2] <= 0.1 * saved(fused_pattentions, 4096)


@pytest.mark.parametrize("norm_type", NORM_ACTIVATIONS)
def test_flash_peak_memory_at_most_three_tenths_of_the_fused_node_at_n_4d(norm_type):
    """Forward + backward at the 150M FFN's shape (d = 768, n = 4d), 1024 tokens, the upstream gradient given
    (as benchmarks/pattention.py measures it)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 768, generator=g).requires_grad_()
    key, value = (torch.randn(3072, 768, generator=g).mul_(0.02).requires_grad_() for _ in range(2))
    upstream = torch.randn(1, 1024, 768, generator=g)

    def peak(fn):
        for t in (x, key, value):
            t.grad = None
        return peak_activation_bytes(lambda: fn(x, [key], [value], norm_type, 1.0, [3072]).backward(upstream),
                                     (x, key, value))

    assert peak(flash_pattentions) <= 0.3 * peak(fused_pattentions)


# --- Flash's host work -----------------------------------------------------------------------------------

def launches(fn, tokens, norm_type, **tiles):
    """torch.profiler's aten operators of one forward + backward of three Pattentions of one input (τ ≠ 1)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, 16, generator=g).requires_grad_()
    keys, values = ([torch.randn(24, 16, generator=g).mul_(0.3).requires_grad_() for _ in range(3)] for _ in "kv")
    upstream = torch.randn(3, tokens, 16, generator=g)
    return aten_operators(lambda: fn(x, keys, values, norm_type, 0.7, [24, 30, 20], **tiles).backward(upstream))


@pytest.mark.parametrize("norm_type", NORM_ACTIVATIONS)
def test_flash_launches_as_many_operators_at_four_times_the_tokens(norm_type):
    """At BLOCKS full blocks of input rows and at four times as many rows flash cuts the same number of blocks,
    and so launches the same operators (a fixed row size would launch about four times as many)."""
    cpu = torch.device("cpu")
    tokens = flash.BLOCKS["cpu"] * flash.MIN_ROWS["cpu"], 4 * flash.BLOCKS["cpu"] * flash.MIN_ROWS["cpu"]
    assert [len(row_blocks(t, cpu)) for t in tokens] == [flash.BLOCKS["cpu"]] * 2
    counts = [launches(flash_pattentions, t, norm_type, tiles=tiles_torch) for t in tokens]
    assert counts[0] == counts[1]


@pytest.mark.parametrize("norm_type", NORM_ACTIVATIONS)
def test_flash_in_one_block_launches_about_what_fused_does(norm_type):
    """An input of MIN_ROWS rows is one block: flash then launches fused's operators, one GEMM more and a fixed
    few (splits, one cat per row statistic), at most 1.5 × fused's with the same tiles, where two blocks would
    launch about twice as many."""
    rows = flash.MIN_ROWS["cpu"]
    assert len(row_blocks(rows, torch.device("cpu"))) == 1
    fused = launches(fused_pattentions, rows, norm_type, tiles=tiles_torch)
    assert launches(flash_pattentions, rows, norm_type, tiles=tiles_torch) <= 1.5 * fused


# --- Attention's fused path ----------------------------------------------------------------------------

def plain_rotary(x, rotary_dims, base):
    """GPT-NeoX rotate-half rotary written out: x [b, h, s, head_dim]; angles in fp32, as GPT-NeoX does."""
    positions = torch.arange(x.shape[-2], dtype=torch.float32)
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dims, 2, dtype=torch.float32) / rotary_dims)
    angles = torch.cat([torch.outer(positions, inv_freq)] * 2, dim=-1)
    rotated, passed = x[..., :rotary_dims], x[..., rotary_dims:]
    first, second = rotated.chunk(2, dim=-1)
    rotated = rotated * angles.cos().to(x.dtype) + torch.cat((-second, first), dim=-1) * angles.sin().to(x.dtype)
    return torch.cat((rotated, passed), dim=-1)


def plain_attention(attention, x, args):
    """SelfAttention's function from plain parts: one `pattention` per projection, autograd everywhere."""
    def project(p, t):
        return pattention(t, p.key_param_tokens, p.value_param_tokens, p.theta, p.tau, p.norm_token_count)

    b, s, d = x.shape
    heads = [project(p, x).view(b, s, args.num_attention_heads, -1).transpose(1, 2)
             for p in (attention.query, attention.key, attention.value)]
    if args.rotary_dims:
        heads[:2] = [plain_rotary(t, args.rotary_dims, args.rotary_emb_base) for t in heads[:2]]
    context = F.scaled_dot_product_attention(*heads, is_causal=True)
    return project(attention.proj, context.transpose(1, 2).reshape(b, s, d))


@pytest.mark.parametrize("norm_type", NORM_ACTIVATIONS)
@pytest.mark.parametrize("pos_emb", ["rotary", "learned"])
@pytest.mark.parametrize("impl", ["fused", "flash"])
def test_attention_equals_its_plain_composition(impl, norm_type, pos_emb):
    args = TokenFormerArgs(padded_vocab_size=8, hidden_size=16, num_layers=1, num_attention_heads=2,
                           qkv_slot_num=12, proj_slot_num=10, ffn_slot_num=8, seq_length=6, pos_emb=pos_emb,
                           rotary_pct=0.5, norm_activation_type=norm_type, pattention_tau=0.8, pattention_impl=impl)
    attention = SelfAttention(args).double()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in attention.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
    x = torch.randn(2, 6, 16, dtype=torch.float64, generator=g).requires_grad_()
    fused, plain = attention(x), plain_attention(attention, x, args)
    torch.testing.assert_close(fused, plain, rtol=1e-10, atol=1e-12)
    upstream = torch.linspace(-1, 1, fused.numel(), dtype=fused.dtype).reshape(fused.shape)
    inputs_ = (x, *attention.parameters())
    for g, e in zip(torch.autograd.grad(fused, inputs_, upstream), torch.autograd.grad(plain, inputs_, upstream)):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-12)
