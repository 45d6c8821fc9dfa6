"""The memory-efficient Pattention equals the plain formula in values and gradients."""

import pytest
import torch
import torch.distributed as dist

from megatron.model.pattention import fused_pattention
from megatron.model.pattention import pattention
from tests.distributed import spawn

NORM_TYPES = ["l2_norm_gelu", "gelu_l2_norm", "softmax"]


def inputs(dtype=torch.float64, n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, 8, generator=g, dtype=dtype)
    key = torch.randn(n, 8, generator=g, dtype=dtype) * 0.5
    value = torch.randn(n, 6, generator=g, dtype=dtype) * 0.5
    return x, key, value


def grads(fn, x, key, value, norm_type, tau, n):
    x, key, value = (t.clone().requires_grad_() for t in (x, key, value))
    out = fn(x, key, value, norm_type, tau, n)
    weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    (out * weight).sum().backward()
    return out.detach(), x.grad, key.grad, value.grad


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_values_and_gradients_equal_the_plain_formula(norm_type, tau):
    x, key, value = inputs()
    expected = grads(pattention, x, key, value, norm_type, tau, 24)
    got = grads(fused_pattention, x, key, value, norm_type, tau, 24)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_gradcheck(norm_type):
    x, key, value = (t.requires_grad_() for t in inputs(n=6))
    assert torch.autograd.gradcheck(lambda a, k, v: fused_pattention(a, k, v, norm_type, 1.3, 9), (x, key, value))


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_bf16_is_close_to_fp32(norm_type):
    x, key, value = inputs(torch.float32)
    reference = grads(fused_pattention, x, key, value, norm_type, 1.0, 24)
    low = grads(fused_pattention, x.bfloat16(), key.bfloat16(), value.bfloat16(), norm_type, 1.0, 24)
    for r, b in zip(reference, low):
        assert b.dtype == torch.bfloat16
        torch.testing.assert_close(b.float(), r, rtol=5e-2, atol=5e-2)


def test_zero_input_row_gives_no_nan():
    x, key, value = inputs()
    x[0, 0] = 0
    for norm_type in NORM_TYPES:
        out, *gs = grads(fused_pattention, x, key, value, norm_type, 1.0, 24)
        assert all(torch.isfinite(t).all() for t in (out, *gs))


def saved_bytes(fn, norm_type):
    """Bytes of activations autograd keeps for backward (parameters and the input excluded)."""
    x, key, value = (t.requires_grad_() for t in inputs(torch.float32, n=512))
    kept = {x.data_ptr(), key.data_ptr(), value.data_ptr()}
    total = 0

    def pack(t):
        nonlocal total
        if t.data_ptr() not in kept:
            kept.add(t.data_ptr())
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x, key, value, norm_type, 1.0, 512).sum().backward()
    return total


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_keeps_at_most_six_tenths_of_the_plain_activations(norm_type):
    assert saved_bytes(fused_pattention, norm_type) <= 0.6 * saved_bytes(pattention, norm_type)


def _tensor_parallel_body(rank, world_size):
    for norm_type in NORM_TYPES:
        _check_block_equals_layer(rank, norm_type)


def _check_block_equals_layer(rank, norm_type):
    x, key, value = inputs()
    block = slice(rank * 12, (rank + 1) * 12)
    x = x.clone().requires_grad_()
    local_key = key[block].clone().requires_grad_()
    local_value = value[block].clone().requires_grad_()

    def reduce_sum(t):
        dist.all_reduce(t)
        return t

    def reduce_max(t):
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    partial = fused_pattention(x, local_key, local_value, norm_type, 1.0, 24, reduce_sum, reduce_max)
    out = partial.detach().clone()
    dist.all_reduce(out)
    weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    (partial * weight).sum().backward()
    grad_x = x.grad.clone()
    dist.all_reduce(grad_x)
    expected = grads(pattention, *inputs(), norm_type, 1.0, 24)
    torch.testing.assert_close(out, expected[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad_x, expected[1], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(local_key.grad, expected[2][block], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(local_value.grad, expected[3][block], rtol=1e-10, atol=1e-12)


def test_token_blocks_on_two_ranks_equal_the_whole_layer():
    spawn(_tensor_parallel_body, 2)
