"""The flash Pattention equals the plain formula (autograd through `pattention`) in values and gradients, for
every Θ, τ ≠ 1, several Pattentions of one input, ragged tiles, fp32 and bf16, token blocks on 2 and 4 real
gloo ranks, with its PyTorch tile functions and with the Triton kernels under Triton's interpreter; growth
leaves the old tokens' results bit-identical; what it keeps for backward does not grow with n."""

import pytest
import torch
import torch.distributed as dist

from benchmarks.activation_memory import peak_activation_bytes, saved_activation_bytes
from megatron.model.pattention import flash, pattention, pattentions_function
from megatron.model.pattention.flash import flash_pattentions
from megatron.model.pattention.fused import fused_pattentions
from tests.distributed import run_on_ranks
from tests.pattention_checks import all_reduce_of, assert_zero_key_growth_is_bit_identical

NORM_TYPES = ["l2_norm_gelu", "gelu_l2_norm", "softmax"]
BACKENDS = ["pytorch", "triton"]


def small_tiles(monkeypatch_or_none=None, key_tile=8, rows=5) -> None:
    """Tiles of `key_tile` tokens and blocks of `rows` input rows, so that small inputs cross several of each
    and end in ragged ones."""
    tile_elements = {"cpu": key_tile * rows, "default": key_tile * rows}
    if monkeypatch_or_none is None:
        flash.KEY_TILE, flash.TILE_ELEMENTS = key_tile, tile_elements
    else:
        monkeypatch_or_none.setattr(flash, "KEY_TILE", key_tile)
        monkeypatch_or_none.setattr(flash, "TILE_ELEMENTS", tile_elements)


def inputs(n=29, count=1, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 7, 12, generator=g, dtype=dtype)
    keys = [torch.randn(n, 12, generator=g, dtype=dtype) * 0.5 for _ in range(count)]
    values = [torch.randn(n, 6, generator=g, dtype=dtype) * 0.5 for _ in range(count)]
    return x, keys, values


def output_weight(out):
    return torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)


def results(fn, x, keys, values):
    """(output, dX, dK..., dV...) of fn(x, keys, values) under a non-uniform upstream gradient."""
    x, *tokens = (t.detach().clone().requires_grad_() for t in (x, *keys, *values))
    out = fn(x, tokens[:len(keys)], tokens[len(keys):])
    grads = torch.autograd.grad((out * output_weight(out)).sum(), [x, *tokens])
    return [out.detach(), *grads]


def plain(norm_type, tau, counts):
    return lambda x, keys, values: torch.stack([pattention(x, k, v, norm_type, tau, n)
                                                for k, v, n in zip(keys, values, counts)])


def flashed(norm_type, tau, counts, backend):
    return lambda x, keys, values: pattentions_function("flash", backend)(x, keys, values, norm_type, tau, counts)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_values_and_gradients_equal_the_plain_formula(monkeypatch, backend, norm_type, tau):
    """fp64, 29 tokens in tiles of 8 and 14 rows in blocks of 5: every tile kind, ragged ones included;
    three Pattentions of one input with different token counts. (The Triton kernels compute in fp32 whatever
    the input dtype, hence their fp32-sized tolerance.)"""
    small_tiles(monkeypatch)
    x, keys, values = inputs(count=3)
    counts = [29, 35, 20]
    expected = results(plain(norm_type, tau, counts), x, keys, values)
    got = results(flashed(norm_type, tau, counts, backend), x, keys, values)
    rtol, atol = (1e-10, 1e-12) if backend == "pytorch" else (1e-5, 1e-6)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=rtol, atol=atol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_fp32_within_1e_5_and_bf16_within_its_own_error_of_the_plain_formula(monkeypatch, backend, norm_type):
    """fp32: within 1e-5 of the plain formula in fp32 (relative to each tensor's largest entry). bf16: within
    1e-2 of the exact result (relative norm of the difference), or within 1.25× the plain formula's own bf16
    error where that is larger."""
    small_tiles(monkeypatch, key_tile=16, rows=8)
    x, keys, values = inputs(n=70)
    exact = results(plain(norm_type, 0.7, [70]), x, keys, values)
    for dtype in (torch.float32, torch.bfloat16):
        cast = [x.to(dtype)], [k.to(dtype) for k in keys], [v.to(dtype) for v in values]
        got = results(flashed(norm_type, 0.7, [70], backend), cast[0][0], cast[1], cast[2])
        own = results(plain(norm_type, 0.7, [70]), cast[0][0], cast[1], cast[2])
        for g, p, e in zip(got, own, exact):
            assert g.dtype == dtype
            if dtype == torch.float32:
                assert (g - p).abs().max() / e.abs().max() <= 1e-5
            else:
                error, own_error = ((t.double() - e).norm() / e.norm() for t in (g, p))
                assert error <= max(1e-2, 1.25 * own_error)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_gradcheck(monkeypatch, norm_type):
    small_tiles(monkeypatch, key_tile=4, rows=3)
    x, keys, values = (t.requires_grad_() for t in (torch.randn(5, 4, dtype=torch.float64),
                                                   torch.randn(9, 4, dtype=torch.float64) * 0.5,
                                                   torch.randn(9, 3, dtype=torch.float64) * 0.5))
    assert torch.autograd.gradcheck(lambda a, k, v: flash_pattentions(a, [k], [v], norm_type, 1.3, [11]),
                                    (x, keys, values))


def test_zero_input_row_gives_no_nan(monkeypatch):
    small_tiles(monkeypatch)
    x, keys, values = inputs()
    x[0, 0] = 0
    for norm_type in NORM_TYPES:
        assert all(torch.isfinite(t).all() for t in results(flashed(norm_type, 1.0, [29], "pytorch"), x, keys, values))


@pytest.mark.parametrize("norm_type", ["l2_norm_gelu", "gelu_l2_norm"])
@pytest.mark.parametrize("tokens, grown", [(32, 64), (64, 128), (96, 192), (512, 1024)])
def test_zero_key_tokens_leave_the_old_tokens_outputs_and_gradients_bit_identical(norm_type, tokens, grown):
    """As the fused node's test (tests/test_fused_pattention.py), at the real tile size: within one tile and
    over whole tiles (the new tiles add exact zeros). Where a row reduction runs over a tile that growth
    lengthens with zeros (a ragged last tile, or the fused node's whole row), the library may sum it in
    another order and the last bits may move, for the plain formula too: test_grow_checkpoint allows that."""
    assert_zero_key_growth_is_bit_identical(flash_pattentions, norm_type, tokens, grown)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_bytes_kept_for_backward_do_not_grow_with_n(norm_type):
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


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_peak_memory_at_most_three_tenths_of_the_fused_node_at_n_4d(norm_type):
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


def test_layer_implementations_agree():
    """The layer's `pattentions_function` dispatches: plain, fused and flash give the same values."""
    x, keys, values = inputs(count=2)
    outs = [pattentions_function(impl)(x, keys, values, "l2_norm_gelu", 1.0, [29, 29])
            for impl in ("plain", "fused", "flash")]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(outs[2], outs[0], rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="pattention_impl='fast'"):
        pattentions_function("fast")


# --- Token blocks on real tensor-parallel ranks ---------------------------------------------------------

def _blocks_on_rank(impl, backend, norm_type, world):
    """This rank's block of each of three Pattentions' tokens, statistics all-reduced over the ranks."""
    small_tiles(key_tile=4, rows=5)
    rank = dist.get_rank()
    x, keys, values = inputs(n=24, count=3)
    block = slice(rank * 24 // world, (rank + 1) * 24 // world)
    x = x.requires_grad_()
    local = [t[block].clone().requires_grad_() for t in keys + values]
    partial = pattentions_function(impl, backend)(x, local[:3], local[3:], norm_type, 0.7, [24, 30, 17],
                                                  all_reduce_of(dist.ReduceOp.SUM), all_reduce_of(dist.ReduceOp.MAX))
    (partial * output_weight(partial)).sum().backward()
    return partial.detach(), x.grad, [t.grad for t in local]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("impl, backend", [("flash", "pytorch"), ("flash", "triton"), ("plain", "auto")])
def test_token_blocks_on_real_ranks_equal_the_whole_layers(world, impl, backend):
    ranks = run_on_ranks(world, _block_checks, impl, backend, world)
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if backend == "triton" else {"rtol": 1e-10, "atol": 1e-12}
    for norm_type, per_rank in zip(NORM_TYPES, zip(*ranks)):
        x, keys, values = inputs(n=24, count=3)
        expected = results(plain(norm_type, 0.7, [24, 30, 17]), x, keys, values)
        torch.testing.assert_close(sum(r[0] for r in per_rank), expected[0], **tolerance)
        torch.testing.assert_close(sum(r[1] for r in per_rank), expected[1], **tolerance)
        for i, e in enumerate(expected[2:]):
            torch.testing.assert_close(torch.cat([r[2][i] for r in per_rank]), e, **tolerance)


def _block_checks(impl, backend, world):
    return [_blocks_on_rank(impl, backend, norm_type, world) for norm_type in NORM_TYPES]
