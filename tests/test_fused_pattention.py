"""The fused Pattention node equals the plain formula (`pattention`, differentiated by autograd) in values and
gradients: every Θ, τ ≠ 1, several Pattentions of one input in one node, token blocks split over real ranks,
fp32 and bf16; and it keeps at most 0.6 of the plain formula's activation memory. Attention's fused path
(Q, K, V in one node, heads and rotary in one node) equals the same attention composed from plain parts."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.activation_memory import peak_activation_bytes, saved_activation_bytes
from megatron.model import TokenFormerArgs
from megatron.model.attention import SelfAttention
from megatron.model.pattention import pattention
from megatron.model.pattention.fused import fused_pattention, fused_pattentions
from tests.distributed import run_on_ranks
from tests.pattention_checks import all_reduce_of, assert_zero_key_growth_is_bit_identical

NORM_TYPES = ["l2_norm_gelu", "gelu_l2_norm", "softmax"]


def inputs(dtype=torch.float64, n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 5, 8, generator=g, dtype=dtype)
    key = torch.randn(n, 8, generator=g, dtype=dtype) * 0.5
    value = torch.randn(n, 6, generator=g, dtype=dtype) * 0.5
    return x, key, value


def output_weight(out):
    """A fixed, non-uniform upstream gradient (a plain sum would hide errors that cancel across a row)."""
    return torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)


def grads(fn, x, key, value, norm_type, tau, n):
    x, key, value = (t.clone().requires_grad_() for t in (x, key, value))
    out = fn(x, key, value, norm_type, tau, n)
    (out * output_weight(out)).sum().backward()
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
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_low_precision_matches_the_fp64_formula_within_its_tolerance(norm_type, dtype, tolerance):
    """fp32 and bf16 runs of the fused node against the plain formula in fp64, at the dtype's tolerance;
    in bf16 the fused node's error is also no larger than the plain formula's own bf16 error (+ a margin)."""
    x, key, value = inputs(n=64)
    exact = grads(pattention, x, key, value, norm_type, 0.7, 64)
    fused = grads(fused_pattention, x.to(dtype), key.to(dtype), value.to(dtype), norm_type, 0.7, 64)
    plain = grads(pattention, x.to(dtype), key.to(dtype), value.to(dtype), norm_type, 0.7, 64)
    for e, f, p in zip(exact, fused, plain):
        assert f.dtype == dtype
        scale = e.abs().max()
        torch.testing.assert_close(f.double() / scale, e / scale, rtol=0, atol=tolerance)
        assert (f.double() - e).abs().max() <= 2 * (p.double() - e).abs().max() + tolerance / 10 * scale


def test_zero_input_row_gives_no_nan():
    x, key, value = inputs()
    x[0, 0] = 0
    for norm_type in NORM_TYPES:
        out, *gs = grads(fused_pattention, x, key, value, norm_type, 1.0, 24)
        assert all(torch.isfinite(t).all() for t in (out, *gs))


def several(n_tokens=(24, 24, 24), counts=(24, 30, 17), seed=1):
    """Three Pattentions of one input (each its own tokens and norm_token_count)."""
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n, 8, generator=g, dtype=torch.float64) * 0.5 for n in n_tokens]
    values = [torch.randn(n, 6, generator=g, dtype=torch.float64) * 0.5 for n in n_tokens]
    return keys, values, list(counts)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_several_pattentions_of_one_input_equal_each_computed_alone(norm_type):
    x = inputs()[0].requires_grad_()
    keys, values, counts = several()
    params = [t.requires_grad_() for t in keys + values]
    stacked = fused_pattentions(x, keys, values, norm_type, 0.7, counts)
    assert stacked.shape == (3, 2, 5, 6)
    (stacked * output_weight(stacked)).sum().backward()
    got = [stacked.detach(), x.grad, *(p.grad for p in params)]

    x_ref = x.detach().clone().requires_grad_()
    refs = [p.detach().clone().requires_grad_() for p in params]
    alone = torch.stack([pattention(x_ref, k, v, norm_type, 0.7, n) for k, v, n in zip(refs[:3], refs[3:], counts)])
    (alone * output_weight(alone)).sum().backward()
    for g, e in zip(got, [alone.detach(), x_ref.grad, *(p.grad for p in refs)]):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("norm_type", ["l2_norm_gelu", "gelu_l2_norm"])
@pytest.mark.parametrize("tokens, grown", [(32, 64), (64, 128), (96, 192)])
def test_zero_key_tokens_leave_the_old_tokens_outputs_and_gradients_bit_identical(norm_type, tokens, grown):
    """Growth appends tokens with zero keys and keeps n: the function, and in fp32 every bit of the old tokens'
    gradients, must not change, whichever side of d_in = d_out = 64 the token count falls (a GEMM order that
    depended on n would move the first update after growth, which Adam's moments then amplify). At these
    sizes the BLAS sums the zero-padded reductions in the same order; at some larger ones it does not, for the
    plain formula too (test_grow_checkpoint allows that rounding)."""
    assert_zero_key_growth_is_bit_identical(fused_pattentions, norm_type, tokens, grown)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_keeps_at_most_six_tenths_of_the_plain_activations(norm_type):
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


# --- Token blocks on real tensor-parallel ranks ---------------------------------------------------------

def _blocks_on_rank(norm_type):
    """On each of 2 ranks: its half of each of three Pattentions' tokens, statistics all-reduced."""
    rank = dist.get_rank()
    x = inputs()[0].requires_grad_()
    keys, values, counts = several()
    block = slice(rank * 12, (rank + 1) * 12)
    local = [t[block].clone().requires_grad_() for t in keys + values]
    reduce_sum, reduce_max = all_reduce_of(dist.ReduceOp.SUM), all_reduce_of(dist.ReduceOp.MAX)
    partial = fused_pattentions(x, local[:3], local[3:], norm_type, 0.7, counts, reduce_sum, reduce_max)
    (partial * output_weight(partial)).sum().backward()
    return partial.detach(), x.grad, [t.grad for t in local]


@pytest.mark.slow
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_token_blocks_on_two_ranks_equal_the_whole_layers(norm_type):
    ranks = run_on_ranks(2, _blocks_on_rank, norm_type)
    x = inputs()[0].requires_grad_()
    keys, values, counts = several()
    params = [t.requires_grad_() for t in keys + values]
    whole = torch.stack([pattention(x, k, v, norm_type, 0.7, n) for k, v, n in zip(params[:3], params[3:], counts)])
    (whole * output_weight(whole)).sum().backward()
    torch.testing.assert_close(ranks[0][0] + ranks[1][0], whole.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ranks[0][1] + ranks[1][1], x.grad, rtol=1e-10, atol=1e-12)
    for i, p in enumerate(params):
        torch.testing.assert_close(torch.cat([ranks[0][2][i], ranks[1][2][i]]), p.grad, rtol=1e-10, atol=1e-12)


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


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("pos_emb", ["rotary", "learned"])
def test_attention_equals_its_plain_composition(norm_type, pos_emb):
    args = TokenFormerArgs(padded_vocab_size=8, hidden_size=16, num_layers=1, num_attention_heads=2,
                           qkv_slot_num=12, proj_slot_num=10, ffn_slot_num=8, seq_length=6, pos_emb=pos_emb,
                           rotary_pct=0.5, norm_activation_type=norm_type, pattention_tau=0.8)
    attention = SelfAttention(args).double()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in attention.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
    x = torch.randn(2, 6, 16, dtype=torch.float64, generator=g).requires_grad_()
    fused, plain = attention(x), plain_attention(attention, x, args)
    torch.testing.assert_close(fused, plain, rtol=1e-10, atol=1e-12)
    upstream = output_weight(fused)
    inputs_ = (x, *attention.parameters())
    for g, e in zip(torch.autograd.grad(fused, inputs_, upstream), torch.autograd.grad(plain, inputs_, upstream)):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-12)
