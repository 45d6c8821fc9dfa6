"""The Pattention contract: every implementation (plain, fused, flash with each tile backend; registry.py)
computes the paper's Θ(τ·X·K_Pᵀ)·V_P, in values and gradients, for every Θ, τ ≠ 1, several Pattentions of
one input, ragged tiles, fp64/fp32/bf16, token blocks on real gloo ranks (tensor parallelism) and growth; and
the stand-alone layer works in any PyTorch code: any leading dimensions, `grow` in both modes, torch.optim
(the README's example: tests/test_readme_example.py). The Triton kernels run under Triton's interpreter on a
CPU and compute in fp32 whatever the input dtype, hence their fp32-sized tolerance. What one implementation
alone promises (memory, the Triton tiles one by one, attention's fused node) is in test_pattention_kernels.py.
"""

import copy
import math
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megatron.config.schema import TRITON_FLASH_BACKENDS
from megatron.model.args import FLASH_BACKENDS, NORM_ACTIVATIONS, PATTENTION_IMPLS
from megatron.model.pattention import (
    ParallelPattention,
    Pattention,
    flash,
    local_row_max,
    local_row_sum,
    normalize_scores,
    parameter_token_scores,
    pattention,
    pattentions_function,
)
from megatron.model.pattention.fused import fused_pattention
from megatron.model.pattention.registry import IMPLEMENTATIONS, TILE_BACKENDS
from tests.distributed import run_on_ranks

IMPLS = [("plain", "auto"), ("fused", "auto"), ("flash", "pytorch"), ("flash", "triton"), ("flash", "kernels"),
         ("fused", "triton")]
IMPL_IDS = ["plain", "fused", "flash-pytorch", "flash-triton", "flash-kernels", "fused-triton"]
EXACT_IMPLS, EXACT_IDS = IMPLS[:3], IMPL_IDS[:3]  # fp64 throughout (the Triton kernels compute in fp32)
L2 = ("l2_norm_gelu", "gelu_l2_norm")


def assert_matches(got, want, backend, exact=(1e-10, 1e-12)):
    """fp64 implementations within `exact` (rtol, atol) elementwise; the Triton kernels, which compute in fp32,
    within 1e-5 of the tensor's largest entry (elementwise, a row sum whose terms cancel has a large relative
    error in fp32 however right the kernel is)."""
    if backend in TRITON_FLASH_BACKENDS:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
    else:
        torch.testing.assert_close(got, want, rtol=exact[0], atol=exact[1])


def small_blocks(monkeypatch=None, rows=5, blocks=None):
    """flash's blocks of `rows` input rows (MIN_ROWS; BLOCKS out of the way), or with `blocks`, of ceil(tokens /
    blocks) rows (BLOCKS; MIN_ROWS out of the way), so that small inputs cross several and end in a ragged one
    (set directly in a forked rank, which the monkeypatch cannot undo anyway)."""
    settings = {"MIN_ROWS": {"cpu": rows, "default": rows}, "BLOCKS": {"cpu": 2**62, "default": 2**62}}
    if blocks is not None:
        settings = {"MIN_ROWS": {"cpu": 1, "default": 1}, "BLOCKS": {"cpu": blocks, "default": blocks}}
    for name, value in settings.items():
        if monkeypatch is None:
            setattr(flash, name, value)
        else:
            monkeypatch.setattr(flash, name, value)


def inputs(n=29, count=1, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 7, 12, generator=g, dtype=dtype)
    keys = [torch.randn(n, 12, generator=g, dtype=dtype) * 0.5 for _ in range(count)]
    values = [torch.randn(n, 6, generator=g, dtype=dtype) * 0.5 for _ in range(count)]
    return x, keys, values


def output_weight(out):
    """A fixed, non-uniform upstream gradient (a plain sum would hide errors that cancel across a row)."""
    return torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)


def results(fn, x, keys, values):
    """(output, dX, dK..., dV...) of fn(x, keys, values) under a non-uniform upstream gradient."""
    x, *tokens = (t.detach().clone().requires_grad_() for t in (x, *keys, *values))
    out = fn(x, tokens[:len(keys)], tokens[len(keys):])
    grads = torch.autograd.grad((out * output_weight(out)).sum(), [x, *tokens])
    return [out.detach(), *grads]


def plain(theta, tau, counts):
    return lambda x, keys, values: torch.stack([pattention(x, k, v, theta, tau, n)
                                                for k, v, n in zip(keys, values, counts)])


def by_registry(impl, backend, theta, tau, counts):
    return lambda x, keys, values: pattentions_function(impl, backend)(x, keys, values, theta, tau, counts)


def exact_gelu(a):
    return 0.5 * a * (1.0 + torch.erf(a / math.sqrt(2.0)))


def paper_formula(x, keys, values, theta, tau):
    """Θ(τ·X·Kᵀ)·V written directly from the paper, with n the number of parameter tokens."""
    scores = tau * x @ keys.T
    n = keys.shape[0]
    if theta == "l2_norm_gelu":
        weights = exact_gelu(scores / scores.norm(dim=-1, keepdim=True) * math.sqrt(n))
    elif theta == "gelu_l2_norm":
        activated = exact_gelu(scores)
        weights = activated / activated.norm(dim=-1, keepdim=True) * math.sqrt(n)
    else:
        exponentials = torch.exp(scores)
        weights = exponentials / exponentials.sum(dim=-1, keepdim=True) * n
    return weights @ values


def random_layer(theta, impl="fused", backend="auto", d_in=8, d_out=6, tokens=10, tau=1.0, dtype=torch.float64,
                 seed=0):
    layer = Pattention(d_in, d_out, tokens, theta, tau, impl=impl, flash_backend=backend).to(dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=dtype))
    return layer


# --- Every implementation computes the formula ---------------------------------------------------------

@pytest.mark.parametrize("tau", [1.0, 0.3])
@pytest.mark.parametrize("theta", NORM_ACTIVATIONS)
@pytest.mark.parametrize("impl, backend", IMPLS, ids=IMPL_IDS)
def test_the_layer_computes_the_papers_formula(monkeypatch, impl, backend, theta, tau):
    small_blocks(monkeypatch)
    layer = random_layer(theta, impl, backend, tau=tau)
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    output = layer(x)
    x_ref, keys, values = (t.detach().clone().requires_grad_()
                           for t in (x, layer.key_param_tokens, layer.value_param_tokens))
    expected = paper_formula(x_ref, keys, values, theta, tau)
    assert_matches(output, expected, backend, (1e-10, 1e-10))
    upstream = torch.randn_like(output)
    grads = torch.autograd.grad(output, (x, layer.key_param_tokens, layer.value_param_tokens), upstream)
    for grad, expected_grad in zip(grads, torch.autograd.grad(expected, (x_ref, keys, values), upstream)):
        assert_matches(grad, expected_grad, backend, (1e-9, 1e-10))


@pytest.mark.parametrize("tau", [1.0, 0.7])
@pytest.mark.parametrize("theta", NORM_ACTIVATIONS)
@pytest.mark.parametrize("impl, backend", IMPLS, ids=IMPL_IDS)
def test_several_pattentions_of_one_input_equal_the_plain_formula(monkeypatch, impl, backend, theta, tau):
    """fp64, 14 rows in flash's blocks of 5 (a ragged last one); three
    Pattentions of one input with different token counts, in one node, each equal to its own plain formula."""
    small_blocks(monkeypatch)
    x, keys, values = inputs(count=3)
    counts = [29, 35, 20]
    got = results(by_registry(impl, backend, theta, tau, counts), x, keys, values)
    assert got[0].shape == (3, 2, 7, 6)
    for g, e in zip(got, results(plain(theta, tau, counts), x, keys, values)):
        assert_matches(g, e, backend)


@pytest.mark.parametrize("theta", NORM_ACTIVATIONS)
@pytest.mark.parametrize("impl, backend", IMPLS, ids=IMPL_IDS)
def test_fp32_and_bf16_are_within_their_tolerance_of_the_formula(monkeypatch, impl, backend, theta):
    """Against the plain formula in fp64, relative to each tensor's largest entry: fp32 within 1e-5, bf16 within
    3e-2, and no more than twice the plain formula's own error (+ a tenth of that tolerance). fp32 also within
    1e-5 of the plain formula in fp32; bf16 within 1e-2 of the exact result in relative norm, or 1.25× the plain
    formula's own bf16 error where that is larger."""
    small_blocks(monkeypatch, rows=8)
    x, keys, values = inputs(n=70)
    exact = results(plain(theta, 0.7, [70]), x, keys, values)
    for dtype, scaled_tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        cast = x.to(dtype), [k.to(dtype) for k in keys], [v.to(dtype) for v in values]
        got = results(by_registry(impl, backend, theta, 0.7, [70]), *cast)
        own = results(plain(theta, 0.7, [70]), *cast)
        for g, p, e in zip(got, own, exact):
            assert g.dtype == dtype
            scale = e.abs().max()
            torch.testing.assert_close(g.double() / scale, e / scale, rtol=0, atol=scaled_tolerance)
            assert (g.double() - e).abs().max() <= 2 * (p.double() - e).abs().max() + scaled_tolerance / 10 * scale
            if dtype == torch.float32:
                assert (g - p).abs().max() / scale <= 1e-5
            else:
                error, own_error = ((t.double() - e).norm() / e.norm() for t in (g, p))
                assert error <= max(1e-2, 1.25 * own_error)


@pytest.mark.parametrize("theta", NORM_ACTIVATIONS)
@pytest.mark.parametrize("impl, backend", IMPLS, ids=IMPL_IDS)
def test_a_bf16_layer_keeps_fp32_statistics_and_is_close_to_fp32(impl, backend, theta):
    layer = random_layer(theta, impl, backend, d_in=32, d_out=16, tokens=64, dtype=torch.float32)
    x = torch.randn(4, 7, 32)
    expected = layer(x)
    layer_bf16 = random_layer(theta, impl, backend, d_in=32, d_out=16, tokens=64, dtype=torch.bfloat16)
    output = layer_bf16(x.to(torch.bfloat16))
    assert output.dtype == torch.bfloat16
    scores = parameter_token_scores(x.to(torch.bfloat16), layer_bf16.key_param_tokens, 1.0)
    assert local_row_sum(scores, theta, local_row_max(scores, theta)).dtype == torch.float32
    assert (output.float() - expected).norm() / expected.norm() < 2e-2


@pytest.mark.parametrize("theta", NORM_ACTIVATIONS)
@pytest.mark.parametrize("impl, backend", EXACT_IMPLS, ids=EXACT_IDS)
def test_gradcheck(monkeypatch, impl, backend, theta):
    small_blocks(monkeypatch, rows=3)
    g = torch.Generator().manual_seed(0)
    x, key, value = (t.requires_grad_() for t in (torch.randn(5, 4, generator=g, dtype=torch.float64),
                                                 torch.randn(9, 4, generator=g, dtype=torch.float64) * 0.5,
                                                 torch.randn(9, 3, generator=g, dtype=torch.float64) * 0.5))
    compute = pattentions_function(impl, backend)
    assert torch.autograd.gradcheck(lambda a, k, v: compute(a, [k], [v], theta, 1.3, [11]), (x, key, value))


@pytest.mark.parametrize("theta", NORM_ACTIVATIONS)
@pytest.mark.parametrize("impl, backend", IMPLS, ids=IMPL_IDS)
def test_a_zero_input_row_gives_no_nan(monkeypatch, impl, backend, theta):
    small_blocks(monkeypatch)
    layer = random_layer(theta, impl, backend, dtype=torch.float32)
    x = torch.randn(3, 8)
    x[1] = 0.0
    x.requires_grad_()
    output = layer(x)
    output.sum().backward()
    assert torch.isfinite(output).all() and torch.isfinite(x.grad).all()
    assert torch.isfinite(layer.key_param_tokens.grad).all() and torch.isfinite(layer.value_param_tokens.grad).all()
    if theta in L2:  # all scores are 0, so GeLU-based weights are 0
        assert torch.equal(output[1], torch.zeros_like(output[1]))


def test_the_functional_forms_equal_the_module():
    layer = random_layer("gelu_l2_norm", dtype=torch.float32)
    x = torch.randn(2, 8)
    for function in (pattention, fused_pattention):
        functional = function(x, layer.key_param_tokens, layer.value_param_tokens, "gelu_l2_norm", 1.0, 10)
        torch.testing.assert_close(functional, layer(x))


def test_names_are_checked_with_every_choice_listed():
    assert tuple(IMPLEMENTATIONS) == PATTENTION_IMPLS and ("auto", *TILE_BACKENDS) == FLASH_BACKENDS
    with pytest.raises(ValueError, match="norm_activation_type='relu'"):
        Pattention(4, 4, 4, "relu")
    with pytest.raises(ValueError, match=re.escape("pattention_impl='fast': must be one of plain, fused, flash")):
        pattentions_function("fast")
    expected = "flash_backend='cuda': must be one of auto, pytorch, triton, kernels"
    with pytest.raises(ValueError, match=re.escape(expected)):
        Pattention(4, 4, 4, impl="flash", flash_backend="cuda")


# --- Tensor parallelism: token blocks ------------------------------------------------------------------

@pytest.mark.parametrize("blocks", [2, 4])
@pytest.mark.parametrize("theta", NORM_ACTIVATIONS)
def test_statistics_combined_over_token_blocks_equal_the_whole(theta, blocks):
    """What tensor parallelism does: each rank holds a block of tokens; max/sum statistics are reduced."""
    layer = random_layer(theta, tokens=12, tau=0.7)
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    key_blocks = layer.key_param_tokens.detach().chunk(blocks)
    value_blocks = layer.value_param_tokens.detach().chunk(blocks)
    scores = [parameter_token_scores(x, keys, layer.tau) for keys in key_blocks]
    local_maxes = [local_row_max(s, theta) for s in scores]
    row_max = None if local_maxes[0] is None else torch.stack(local_maxes).amax(dim=0)
    row_sum = sum(local_row_sum(s, theta, row_max) for s in scores)
    output = sum(normalize_scores(s, theta, row_sum, row_max, layer.norm_token_count).to(x.dtype) @ values
                 for s, values in zip(scores, value_blocks))
    torch.testing.assert_close(output, layer(x), rtol=1e-6, atol=1e-6)


def all_reduce_of(op):
    """A plain (non-autograd) all-reduce over the world, as a node's `reduce_sum` / `reduce_max`."""
    def reduce(t):
        t = t.clone()
        dist.all_reduce(t, op=op)
        return t
    return reduce


def _blocks_on_rank(impl, backend, world):
    """For each Θ: this rank's block of each of three Pattentions' tokens, statistics all-reduced; flash cuts the
    14 input rows into 3 blocks (5, 5 and 4 rows) on every rank, whatever its number of tokens."""
    small_blocks(blocks=3)
    rank, shares = dist.get_rank(), []
    for theta in NORM_ACTIVATIONS:
        x, keys, values = inputs(n=26, count=3)
        block = slice(rank * 26 // world, (rank + 1) * 26 // world)  # 4 ranks: 6, 7, 6 and 7 tokens
        x = x.requires_grad_()
        local = [t[block].clone().requires_grad_() for t in keys + values]
        partial = pattentions_function(impl, backend)(x, local[:3], local[3:], theta, 0.7, [26, 30, 17],
                                                      all_reduce_of(dist.ReduceOp.SUM),
                                                      all_reduce_of(dist.ReduceOp.MAX))
        (partial * output_weight(partial)).sum().backward()
        shares.append((partial.detach(), x.grad, [t.grad for t in local]))
    return shares


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("impl, backend", IMPLS, ids=IMPL_IDS)
def test_token_blocks_on_real_ranks_equal_the_whole_layers(world, impl, backend):
    ranks = run_on_ranks(world, _blocks_on_rank, impl, backend, world)
    for theta, per_rank in zip(NORM_ACTIVATIONS, zip(*ranks)):
        x, keys, values = inputs(n=26, count=3)
        expected = results(plain(theta, 0.7, [26, 30, 17]), x, keys, values)
        assert_matches(sum(r[0] for r in per_rank), expected[0], backend)
        assert_matches(sum(r[1] for r in per_rank), expected[1], backend)
        for i, e in enumerate(expected[2:]):
            assert_matches(torch.cat([r[2][i] for r in per_rank]), e, backend)


# --- Growth --------------------------------------------------------------------------------------------

def grown_copy(layer, new_count, mode):
    bigger = copy.deepcopy(layer)
    bigger.grow(new_count, mode)
    return bigger


@pytest.fixture
def two_threads():
    """Torch's two threads on this machine, whatever a test before in the process left."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("tokens, grown", [(32, 64), (64, 128), (96, 192), (512, 1024)])
@pytest.mark.parametrize("impl", ["fused", "flash"])
@pytest.mark.parametrize("theta", L2)
def test_preserve_growth_keeps_every_bit_of_the_output_and_the_old_gradients(monkeypatch, two_threads, theta, impl,
                                                                             tokens, grown):
    """Three Pattentions of one input (d_in = d_out = 64) grown with zero keys and the old n: in fp32 the output,
    dX and the old tokens' gradients keep every bit, whichever side of d the token count falls (a GEMM order that
    depended on n would move the first update after growth, which Adam's moments then amplify); flash over three
    blocks of the 256 input rows (86, 86 and 84), a partition made from the input rows alone, which growth leaves
    as it was. Where a row reduction runs over a row that growth
    lengthens with zeros, the library may sum it in another order and the last bits may move, for the plain
    formula too (on this CPU at 600 -> 1200 tokens; test_grow_checkpoint allows that): hence these sizes, at the
    two threads torch takes on this machine (on one thread it sums 512 -> 1024 tokens in another order)."""
    small_blocks(monkeypatch, blocks=3)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, 64, generator=g)
    layers = [Pattention(64, 64, tokens, theta, impl=impl) for _ in range(3)]
    with torch.no_grad():
        for layer in layers:
            layer.key_param_tokens.copy_(torch.randn(tokens, 64, generator=g) * 0.1)
            layer.value_param_tokens.copy_(torch.randn(tokens, 64, generator=g) * 0.1)
    upstream = torch.randn(3, 4, 64, 64, generator=g)

    def run(layers):
        x_leaf = x.clone().requires_grad_()
        out = layers[0].run(layers, x_leaf)
        (out * upstream).sum().backward()
        return out.detach(), x_leaf.grad, [p.grad[:tokens] for layer in layers for p in layer.parameters()]

    out, grad_x, grads = run(layers)
    grown_out, grown_grad_x, grown_grads = run([grown_copy(layer, grown, "preserve") for layer in layers])
    assert torch.equal(grown_out, out) and torch.equal(grown_grad_x, grad_x)
    assert all(torch.equal(a, b) for a, b in zip(grown_grads, grads))


@pytest.mark.parametrize("dtype, atol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
@pytest.mark.parametrize("theta", L2)
@pytest.mark.parametrize("impl, backend", IMPLS, ids=IMPL_IDS)
def test_preserve_growth_keeps_the_function_and_n(monkeypatch, impl, backend, theta, dtype, atol):
    """fp64: N(0, 1) tokens; fp32: the stand-alone init, as a user's layer grows."""
    small_blocks(monkeypatch)
    torch.manual_seed(0)
    layer = (random_layer(theta, impl, backend) if dtype == torch.float64
             else Pattention(8, 6, 10, theta, impl=impl, flash_backend=backend))
    x = torch.randn(4, 8, dtype=dtype)
    bigger = grown_copy(layer, 15, "preserve")
    assert bigger.key_param_tokens.shape == (15, 8) and bigger.value_param_tokens.shape == (15, 6)
    assert torch.equal(bigger.key_param_tokens[10:], torch.zeros(5, 8, dtype=dtype))
    assert bigger.value_param_tokens[10:].abs().sum() > 0
    torch.testing.assert_close(bigger(x), layer(x), rtol=0, atol=atol if backend not in TRITON_FLASH_BACKENDS else 1e-6)
    # the grown layer keeps the original n, saved with its weights
    assert bigger.state_dict()["norm_token_count"].item() == 10 and bigger.norm_token_count.dtype == torch.int64


def test_preserve_growth_of_softmax_is_refused_because_zero_keys_change_it():
    """exp(0) = 1 gives every new token weight, so softmax Pattention is not growth-invariant."""
    layer = random_layer("softmax", dtype=torch.float32)
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"grow\(mode='preserve'\) of a softmax Pattention: .* mode='official'"):
        layer.grow(15, "preserve")
    assert len(layer.key_param_tokens) == 10
    zero_keys = copy.deepcopy(layer)
    zero_keys.key_param_tokens = nn.Parameter(torch.cat([layer.key_param_tokens.detach(), torch.zeros(5, 8)]))
    zero_keys.value_param_tokens = nn.Parameter(torch.cat([layer.value_param_tokens.detach(), torch.randn(5, 6)]))
    assert not torch.allclose(zero_keys(x), layer(x), atol=1e-3)


@pytest.mark.parametrize("theta", NORM_ACTIVATIONS)
def test_official_growth_draws_new_keys_and_normalises_by_the_new_count(theta):
    layer = random_layer(theta, dtype=torch.float32)
    bigger = grown_copy(layer, 16, "official")
    assert bigger.norm_token_count.item() == 16 and bigger.norm_token_count.dtype == torch.int64
    assert torch.equal(bigger.key_param_tokens[:10], layer.key_param_tokens)
    assert torch.equal(bigger.value_param_tokens[:10], layer.value_param_tokens)
    assert (bigger.key_param_tokens[10:] != 0).all() and (bigger.value_param_tokens[10:] != 0).all()
    x = torch.randn(4, 8)
    assert not torch.allclose(bigger(x), layer(x), atol=1e-3)


def test_shrinking_an_unknown_mode_and_a_tensor_parallel_block_are_refused():
    layer = random_layer("l2_norm_gelu")
    with pytest.raises(ValueError, match=re.escape("grow(new_count=9): the layer has 10 parameter tokens, and growth "
                                                   "only appends tokens")):
        layer.grow(9)
    with pytest.raises(ValueError, match=re.escape("mode='exact': must be one of preserve, official")):
        layer.grow(12, "exact")
    with pytest.raises(NotImplementedError, match="tools/grow_checkpoint.py"):
        ParallelPattention(8, 8, 4).grow(8)


# --- The stand-alone layer -----------------------------------------------------------------------------

@pytest.mark.parametrize("impl, backend", IMPLS, ids=IMPL_IDS)
def test_any_leading_dimensions_equal_the_flattened_tokens(impl, backend):
    torch.manual_seed(0)
    layer = Pattention(8, 6, 10, impl=impl, flash_backend=backend)
    image = torch.randn(2, 3, 5, 8)  # [batch, h, w, d]
    out = layer(image)
    assert out.shape == (2, 3, 5, 6)
    torch.testing.assert_close(out.reshape(-1, 6), layer(image.reshape(-1, 8)), rtol=0, atol=1e-6)


def test_a_new_layer_is_initialised_and_the_meta_device_draws_nothing():
    layer = Pattention(64, 32, 256)
    assert layer.impl == "fused" and layer.theta == "l2_norm_gelu" and layer.norm_token_count.item() == 256
    for tokens in (layer.key_param_tokens, layer.value_param_tokens):
        assert tokens.mean().abs() < 0.002 and 0.019 < tokens.std() < 0.021
    state = torch.random.get_rng_state()
    meta = Pattention(64, 32, 256, device="meta")
    assert torch.equal(torch.random.get_rng_state(), state) and meta.key_param_tokens.is_meta
    state = layer.state_dict()
    assert set(state) == {"key_param_tokens", "value_param_tokens", "norm_token_count"}
    assert state["norm_token_count"].dtype == torch.int64 and state["norm_token_count"].item() == 256
    layer.to(torch.bfloat16)
    assert layer.norm_token_count.dtype == torch.int64
    assert "norm_token_count" not in dict(layer.named_parameters())


@pytest.mark.parametrize("impl", PATTENTION_IMPLS)
def test_train_grow_and_train_on_with_a_rebuilt_optimizer(impl):
    torch.manual_seed(0)
    layer = Pattention(8, 6, 10, impl=impl)
    x, target = torch.randn(16, 8), torch.randn(16, 6)

    def train(optimizer, steps):
        losses = []
        for _ in range(steps):
            optimizer.zero_grad()
            loss = (layer(x) - target).square().mean()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses

    before = torch.optim.Adam(layer.parameters(), lr=1e-2)
    train(before, 5)
    layer.grow(20)
    assert layer.norm_token_count.item() == 20  # the default mode is the config's: official
    new_keys = layer.key_param_tokens[10:].detach().clone()
    losses = train(torch.optim.Adam(layer.parameters(), lr=1e-2), 20)
    assert layer.key_param_tokens.grad.shape == (20, 8) and layer.key_param_tokens.grad[10:].abs().sum() > 0
    assert not torch.equal(layer.key_param_tokens[10:], new_keys) and losses[-1] < losses[0]


def test_an_optimizer_built_before_grow_trains_the_new_tokens_or_is_refused_with_the_fix():
    """grow() keeps the Parameter objects: an optimizer built before it but not yet stepped trains every token; one
    holding moments of the old size is refused at its next step, before it changes anything."""
    torch.manual_seed(0)
    layer = Pattention(8, 6, 10)
    x, target = torch.randn(16, 8), torch.randn(16, 6)
    fresh = torch.optim.Adam(layer.parameters(), lr=1e-2)
    layer.grow(20)
    (layer(x) - target).square().mean().backward()
    new_values = layer.value_param_tokens[10:].detach().clone()
    fresh.step()
    assert not torch.equal(layer.value_param_tokens[10:], new_values)  # the new tokens train
    stepped = torch.optim.SGD(layer.parameters(), lr=1e-2, momentum=0.9)
    (layer(x) - target).square().mean().backward()
    stepped.step()
    layer.grow(24)
    (layer(x) - target).square().mean().backward()
    weights = [p.detach().clone() for p in layer.parameters()]
    with pytest.raises(RuntimeError) as refused:
        stepped.step()
    assert str(refused.value) == (
        "SGD.step(): a Pattention grew from 20 to 24 parameter tokens after this optimizer stepped, and its state "
        "(momentum_buffer) still has 20 rows; build a new optimizer over the layer's parameters after grow(), or grow "
        "before the first step")
    assert all(torch.equal(p, w) for p, w in zip(layer.parameters(), weights))
    torch.optim.SGD(layer.parameters(), lr=1e-2, momentum=0.9).step()  # a new optimizer steps


def test_the_layer_takes_a_dtype_and_refuses_a_scale_that_is_not_positive_and_finite():
    """tau=0.0 was accepted: every score 0, a layer that can never learn (pattention_tau refuses it)."""
    layer = Pattention(8, 6, 10, dtype=torch.bfloat16)
    assert layer.key_param_tokens.dtype == layer.value_param_tokens.dtype == torch.bfloat16
    assert layer.norm_token_count.dtype == torch.int64 and layer(torch.randn(2, 8, dtype=torch.bfloat16)).isfinite().all()
    assert Pattention(8, 6, 10, dtype=torch.float64, device="meta").key_param_tokens.dtype == torch.float64
    for tau in (float("nan"), float("inf"), 0.0, -1.0):
        with pytest.raises(ValueError) as error:
            Pattention(8, 6, 10, tau=tau)
        assert str(error.value) == f"Pattention(tau={tau!r}): must be a positive finite number (the score scale)"
    assert Pattention(8, 6, 10, tau=1e-3).tau == 1e-3
    with pytest.raises(TypeError, match=r"Pattention\(tau='1'\): must be a positive finite number \(the score "
                                        r"scale\), not a str"):
        Pattention(8, 6, 10, tau="1")
    with pytest.raises(TypeError, match=r"Pattention\(dtype=torch.int64\): must be a floating-point torch.dtype"):
        Pattention(8, 6, 10, dtype=torch.int64)


# --- Arguments and input checked at the boundary (issue 42) ---------------------------------------------

@pytest.mark.parametrize(("args", "message"), [
    ((32, 16, 0), "Pattention(n=0): must be a positive int (the number of parameter tokens)"),
    ((-4, 16, 8), "Pattention(d_in=-4): must be a positive int (the width of the input)"),
    ((32, 16.0, 8), "Pattention(d_out=16.0): must be a positive int (the width of the output), not a float"),
    ((32, True, 8), "Pattention(d_out=True): must be a positive int (the width of the output), not a bool"),
    ((32, 16, 8.5), "Pattention(n=8.5): must be a positive int (the number of parameter tokens), not a float"),
])
def test_sizes_that_are_not_positive_ints_are_refused_naming_the_argument(args, message):
    """Pattention(32, 16, 0) was accepted and learned nothing (fused's backward divided by zero); floats, bools
    and negative sizes ended in torch errors 9-11 frames deep."""
    with pytest.raises((ValueError, TypeError)) as error:
        Pattention(*args)
    assert str(error.value) == message


def test_grow_takes_an_int():
    layer = Pattention(8, 6, 10)
    with pytest.raises(TypeError) as error:
        layer.grow(20.0)
    assert str(error.value) == "grow(new_count=20.0): must be an int (the new number of parameter tokens), not a float"


@pytest.mark.parametrize("impl, backend", IMPLS, ids=IMPL_IDS)
def test_input_that_does_not_fit_the_layer_gets_one_error_naming_it(impl, backend):
    layer = Pattention(8, 6, 10, impl=impl, flash_backend=backend)
    cases = [
        (torch.randn(4, 5), ValueError, "Pattention input: the last dimension is 5 (shape [4, 5]) but d_in is 8; "
                                        "the input must be [..., 8]"),
        (torch.tensor(1.0), ValueError, "Pattention input: a 0-dim tensor; the input must be [..., 8]"),
        (torch.randn(4, 8).numpy(), TypeError, "Pattention input: a numpy.ndarray, not a torch.Tensor; convert it "
                                               "with torch.from_numpy(x) (and .float())"),
        (torch.ones(4, 8, dtype=torch.int64), TypeError, "Pattention input: torch.int64, but the layer computes in "
                                                         "torch.float32; cast it with x.to(torch.float32)"),
        (torch.ones(4, 8, dtype=torch.complex64), TypeError, "Pattention input: torch.complex64, but the layer "
                                                             "computes in torch.float32; cast it with "
                                                             "x.to(torch.float32)"),
        (torch.randn(4, 8, dtype=torch.float64), TypeError, "Pattention input: torch.float64, but the layer computes "
                                                            "in torch.float32; cast it with x.to(torch.float32), the "
                                                            "layer with layer.to(torch.float64), or run it under "
                                                            "torch.autocast"),
    ]
    for x, kind, message in cases:
        with pytest.raises(kind) as error:
            layer(x)
        assert str(error.value) == message


@pytest.mark.parametrize("impl, backend", IMPLS, ids=IMPL_IDS)
def test_under_autocast_the_layer_computes_in_its_dtype_as_linear_does(impl, backend):
    """nn.Linear users expect autocast to cast input and weights; plain did, fused ignored it, flash failed."""
    torch.manual_seed(0)
    layer = Pattention(8, 6, 10, impl=impl, flash_backend=backend)
    x = torch.randn(4, 8)
    for given in (torch.float32, torch.float64, torch.bfloat16):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x.to(given))
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), layer(x), rtol=0.05, atol=0.02)
        y.float().sum().backward()
        assert layer.key_param_tokens.grad.dtype == torch.float32 and layer.key_param_tokens.grad.abs().sum() > 0
