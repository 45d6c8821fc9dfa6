"""Pattention against the paper's formulas, and the properties tensor parallelism and model growth rely on."""

import math

import pytest
import torch

from megatron.model import Pattention, pattention
from megatron.model.pattention import local_row_max, local_row_sum, normalize_scores, parameter_token_scores

NORM_TYPES = ("l2_norm_gelu", "gelu_l2_norm", "softmax")
L2_TYPES = ("l2_norm_gelu", "gelu_l2_norm")


def exact_gelu(a):
    return 0.5 * a * (1.0 + torch.erf(a / math.sqrt(2.0)))


def reference_pattention(x, keys, values, norm_type, tau):
    """Θ(τ·X·Kᵀ)·V written directly from the paper, with n the number of parameter tokens."""
    scores = tau * x @ keys.T
    n = keys.shape[0]
    if norm_type == "l2_norm_gelu":
        weights = exact_gelu(scores / scores.norm(dim=-1, keepdim=True) * math.sqrt(n))
    elif norm_type == "gelu_l2_norm":
        activated = exact_gelu(scores)
        weights = activated / activated.norm(dim=-1, keepdim=True) * math.sqrt(n)
    else:
        exponentials = torch.exp(scores)
        weights = exponentials / exponentials.sum(dim=-1, keepdim=True) * n
    return weights @ values


def random_layer(norm_type, d_in=8, d_out=6, tokens=10, tau=1.0, dtype=torch.float64, seed=0):
    layer = Pattention(d_in, d_out, tokens, norm_type, tau).to(dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=dtype))
    return layer


@pytest.mark.parametrize("tau", [1.0, 0.3])
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_values_and_gradients_match_the_formula(norm_type, tau):
    layer = random_layer(norm_type, tau=tau)
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    output = layer(x)

    x_ref = x.detach().clone().requires_grad_()
    keys = layer.key_param_tokens.detach().clone().requires_grad_()
    values = layer.value_param_tokens.detach().clone().requires_grad_()
    expected = reference_pattention(x_ref, keys, values, norm_type, tau)
    torch.testing.assert_close(output, expected, rtol=1e-10, atol=1e-10)

    upstream = torch.randn_like(output)
    grads = torch.autograd.grad(output, (x, layer.key_param_tokens, layer.value_param_tokens), upstream)
    expected_grads = torch.autograd.grad(expected, (x_ref, keys, values), upstream)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-10)


def test_norm_token_count_is_a_fixed_int64_buffer_saved_in_the_state_dict():
    layer = Pattention(4, 4, 7, "l2_norm_gelu")
    state = layer.state_dict()
    assert state["norm_token_count"].dtype == torch.int64 and state["norm_token_count"].item() == 7
    assert "norm_token_count" not in dict(layer.named_parameters())
    layer.to(torch.bfloat16)
    assert layer.norm_token_count.dtype == torch.int64


def grown(layer, extra_tokens, seed=1):
    """The same layer with `extra_tokens` appended: zero keys, arbitrary values (model growth)."""
    generator = torch.Generator().manual_seed(seed)
    keys, values = layer.key_param_tokens.detach(), layer.value_param_tokens.detach()
    new_values = torch.randn(extra_tokens, values.shape[1], generator=generator, dtype=values.dtype)
    bigger = Pattention(keys.shape[1], values.shape[1], keys.shape[0] + extra_tokens, layer.theta).to(keys.dtype)
    with torch.no_grad():
        bigger.key_param_tokens.copy_(torch.cat([keys, torch.zeros(extra_tokens, keys.shape[1], dtype=keys.dtype)]))
        bigger.value_param_tokens.copy_(torch.cat([values, new_values]))
    bigger.norm_token_count.copy_(layer.norm_token_count)
    return bigger


@pytest.mark.parametrize("norm_type", L2_TYPES)
def test_appending_zero_key_tokens_keeps_the_l2_variants_unchanged(norm_type):
    layer = random_layer(norm_type)
    x = torch.randn(4, 8, dtype=torch.float64)
    bigger = grown(layer, extra_tokens=5)
    torch.testing.assert_close(bigger(x), layer(x), rtol=0, atol=1e-12)
    # loading the grown weights keeps the original n (the buffer travels in the state_dict)
    assert bigger.state_dict()["norm_token_count"].item() == 10


def test_appending_zero_key_tokens_changes_softmax():
    """exp(0) = 1 gives every new token weight, so softmax Pattention is not growth-invariant."""
    layer = random_layer("softmax", dtype=torch.float32)
    x = torch.randn(4, 8)
    assert not torch.allclose(grown(layer, extra_tokens=5)(x), layer(x), atol=1e-3)


@pytest.mark.parametrize("blocks", [2, 4])
@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_statistics_combined_over_token_blocks_equal_the_whole(norm_type, blocks):
    """What tensor parallelism does: each rank holds a block of tokens; max/sum statistics are reduced."""
    layer = random_layer(norm_type, tokens=12, tau=0.7)
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    key_blocks = layer.key_param_tokens.detach().chunk(blocks)
    value_blocks = layer.value_param_tokens.detach().chunk(blocks)

    scores = [parameter_token_scores(x, keys, layer.tau) for keys in key_blocks]
    local_maxes = [local_row_max(s, norm_type) for s in scores]
    row_max = None if local_maxes[0] is None else torch.stack(local_maxes).amax(dim=0)
    row_sum = sum(local_row_sum(s, norm_type, row_max) for s in scores)
    output = sum(normalize_scores(s, norm_type, row_sum, row_max, layer.norm_token_count).to(x.dtype) @ values
                 for s, values in zip(scores, value_blocks))

    torch.testing.assert_close(output, layer(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_bf16_runs_with_fp32_statistics_and_is_close_to_fp32(norm_type):
    layer = random_layer(norm_type, d_in=32, d_out=16, tokens=64, dtype=torch.float32)
    x = torch.randn(4, 7, 32)
    expected = layer(x)
    layer_bf16 = random_layer(norm_type, d_in=32, d_out=16, tokens=64, dtype=torch.bfloat16)
    output = layer_bf16(x.to(torch.bfloat16))
    assert output.dtype == torch.bfloat16
    scores = parameter_token_scores(x.to(torch.bfloat16), layer_bf16.key_param_tokens, 1.0)
    assert local_row_sum(scores, norm_type, local_row_max(scores, norm_type)).dtype == torch.float32
    relative_error = (output.float() - expected).norm() / expected.norm()
    assert relative_error < 2e-2


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_zero_input_row_gives_no_nan(norm_type):
    layer = random_layer(norm_type, dtype=torch.float32)
    x = torch.randn(3, 8)
    x[1] = 0.0
    x.requires_grad_()
    output = layer(x)
    output.sum().backward()
    assert torch.isfinite(output).all() and torch.isfinite(x.grad).all()
    assert torch.isfinite(layer.key_param_tokens.grad).all()
    if norm_type in L2_TYPES:  # all scores are 0, so GeLU-based weights are 0
        assert torch.equal(output[1], torch.zeros_like(output[1]))


def test_functional_form_equals_the_module():
    layer = random_layer("gelu_l2_norm", dtype=torch.float32)
    x = torch.randn(2, 8)
    functional = pattention(x, layer.key_param_tokens, layer.value_param_tokens, "gelu_l2_norm", 1.0, 10)
    torch.testing.assert_close(functional, layer(x))


def test_unknown_norm_type_is_rejected_naming_the_key():
    with pytest.raises(ValueError, match="norm_activation_type='relu'"):
        Pattention(4, 4, 4, "relu")
