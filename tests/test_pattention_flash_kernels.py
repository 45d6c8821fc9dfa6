"""Flash Pattention's Triton kernels (megatron/model/pattention/flash_triton.py), here under Triton's interpreter:
for each Θ they cover they equal the fused node (fp32, bf16) and the PyTorch reference (fp64, values and
gradients) on shapes that end in a ragged tile on every axis (input rows, parameter tokens, d_in, d_out), three
Pattentions of one input with norm_token_count ≠ n; a grown layer with frozen old tokens keeps its function to the
bit; what they keep for backward and hold at their peak does not grow with n; and one forward + backward launches
as many kernels at 16,384 tokens as at 2,048, at most fused's + 3. Tensor parallelism (token blocks on 2 and 4
gloo ranks) is tests/test_pattention_contract.py's token-block test, whose flash-kernels case runs these kernels.
"""

from __future__ import annotations

import copy

import pytest
import torch

from megatron.model.pattention import flash_triton  # isort: skip  (first: switches on the interpreter on a CPU)
from benchmarks.activation_memory import peak_activation_bytes, saved_activation_bytes
from benchmarks.launches import device_launches
from megatron.model.frozen_tokens import freeze_leading_tokens
from megatron.model.memory import pattention_bytes_per_token
from megatron.model.pattention import Pattention, pattention, pattentions_function
from megatron.model.pattention.registry import FLASH_KERNEL_THETAS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TILES = flash_triton.tiles_for(torch.device(DEVICE))


def ragged(*tiles: int) -> int:
    """A size that crosses into a second tile of each of `tiles`, and ends inside it."""
    return max(tiles) + max(tiles) // 2 + 3


ROWS, N = ragged(TILES.m), ragged(TILES.n)
D_IN, D_OUT = ragged(TILES.k, TILES.d), ragged(TILES.k, TILES.d) - 10  # both reduced over and tiled as outputs
COUNTS = [N, N + 30, N - 40]  # Θ's n: the token count, and two others
TAU = 0.7


def inputs(n: int = N, count: int = 3, seed: int = 0) -> tuple[torch.Tensor, list, list]:
    """fp64 input and tokens on DEVICE, scaled so that the scores are of order one."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(DEVICE)

    return (randn(ROWS, D_IN), [randn(n, D_IN, scale=D_IN**-0.5) for _ in range(count)],
            [randn(n, D_OUT, scale=0.5) for _ in range(count)])


def results(compute, x, keys, values, dtype) -> list[torch.Tensor]:
    """(Y, dX, dK..., dV...) of compute(x, keys, values) in `dtype` under a non-uniform upstream gradient."""
    x, *tokens = (t.detach().to(dtype).requires_grad_() for t in (x, *keys, *values))
    out = compute(x, tokens[:len(keys)], tokens[len(keys):])
    weight = torch.linspace(-1, 1, out.numel(), dtype=dtype, device=out.device).reshape(out.shape)
    return [out.detach(), *torch.autograd.grad((out * weight).sum(), [x, *tokens])]


def by_registry(impl: str, backend: str, theta: str, counts=COUNTS):
    return lambda x, keys, values: pattentions_function(impl, backend)(x, keys, values, theta, TAU, counts)


def reference(theta: str, counts=COUNTS):
    """The plain formula under autograd."""
    return lambda x, keys, values: torch.stack([pattention(x, k, v, theta, TAU, n)
                                                for k, v, n in zip(keys, values, counts)])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("theta", FLASH_KERNEL_THETAS)
def test_the_kernels_equal_the_reference_in_fp64_and_fused_in_fp32_and_bf16(theta, dtype):
    """fp64: within 1e-12 of the reference's largest entry, each tensor. fp32: within 1e-5 of fused in fp32,
    relative to the exact tensor's largest entry. bf16: within 1e-2 of the exact result in relative norm, or
    1.25 × fused's own bf16 error where that is larger."""
    x, keys, values = inputs()
    assert ROWS % TILES.m and N % TILES.n and D_IN % TILES.d and D_OUT % TILES.d and D_OUT > TILES.k
    got = results(by_registry("flash", "kernels", theta), x, keys, values, dtype)
    exact = results(reference(theta), x, keys, values, torch.float64)
    names = ["Y", "dX", *(f"dK{b}" for b in range(3)), *(f"dV{b}" for b in range(3))]
    assert got[0].shape == (3, ROWS, D_OUT)
    fused = None if dtype == torch.float64 else results(by_registry("fused", "auto", theta), x, keys, values, dtype)
    for i, (name, result, want) in enumerate(zip(names, got, exact)):
        assert result.dtype == dtype, name
        if dtype == torch.float64:
            torch.testing.assert_close(result, want, rtol=0, atol=1e-12 * want.abs().max().item(), msg=name)
        elif dtype == torch.float32:
            assert (result - fused[i]).abs().max() <= 1e-5 * want.abs().max(), name
        else:
            error, fused_error = ((t.double() - want).norm() / want.norm() for t in (result, fused[i]))
            assert error <= max(1e-2, 1.25 * fused_error), (name, error, fused_error)


@pytest.mark.parametrize("theta", FLASH_KERNEL_THETAS)
def test_a_grown_layer_with_frozen_old_tokens_keeps_every_bit_and_trains_its_new_tokens_as_fused(theta):
    """preserve growth N -> N + 40 (zero keys; norm_token_count stays N, ≠ n) and the old N tokens frozen
    (freeze_old_param_tokens: the kernels get the tokens as cat(buffer, parameter)): in fp32 the output and dX
    keep every bit of the un-grown layer's (the zero keys' scores add exact zeros, the tiles sum in the same
    order), and the new tokens' gradients, the only ones, equal fused's to fp32 precision (relative to dK's
    largest)."""
    x, (key,), (value,) = inputs(count=1)
    layer = Pattention(D_IN, D_OUT, N, theta, TAU, impl="flash", flash_backend="kernels", device=DEVICE)
    with torch.no_grad():
        layer.key_param_tokens.copy_(key)
        layer.value_param_tokens.copy_(value)

    def run(layer):
        x_leaf = x.float().requires_grad_()
        out = layer(x_leaf)
        (out * torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape)).sum().backward()
        return out.detach(), x_leaf.grad, [p.grad for p in layer.parameters()]

    out, grad_x, _ = run(layer)
    layer.grow(N + 40, mode="preserve")
    freeze_leading_tokens(layer, N, torch.float32)
    trainable = list(layer.parameters())
    assert [len(p) for p in trainable] == [40, 40] and layer.norm_token_count.item() == N
    grown_out, grown_grad_x, grads = run(layer)
    assert torch.equal(grown_out, out) and torch.equal(grown_grad_x, grad_x)
    fused = copy.deepcopy(layer)
    fused.impl = "fused"
    assert grads[0].abs().max() > 0  # the new keys learn (their values, weighted by GeLU(0) = 0, not yet)
    for grad, fused_grad in zip(grads, run(fused)[2]):
        torch.testing.assert_close(grad, fused_grad, rtol=0, atol=1e-5 * grads[0].abs().max().item())


def test_kept_and_peak_memory_do_not_grow_with_n():
    """Saved-tensor hooks: besides τX (here τ = 1: X itself) and the parameters, a call keeps what the memory
    model says (megatron/model/memory.py: two fp32 row statistics a row) and Θ's n (fp32), at n and about 4n
    alike. The storages created during forward + backward (the weight gradients left out): the same peak at
    both, at the larger at least one fp32 [rows × n] score matrix below the fused node's. One Θ: both run the
    same kernels, the same buffers."""
    theta = "l2_norm_gelu"
    kept, peaks = [], []
    for n in (N // 4, N):
        x, keys, values = inputs(n=n, count=1)
        x, key, value = (t.float().requires_grad_() for t in (x, *keys, *values))

        def forward(impl="flash"):
            backend = "kernels" if impl == "flash" else "triton"
            return pattentions_function(impl, backend)(x, [key], [value], theta, 1.0, [n])

        kept.append(saved_activation_bytes(forward, exclude=(x, key, value)))
        for impl in ("flash", "fused"):
            x.grad = key.grad = value.grad = None
            peaks.append(peak_activation_bytes(lambda: forward(impl).sum().backward(), (x, key, value)))
    assert kept == [ROWS * pattention_bytes_per_token("flash", theta, n, 4) + 4 for n in (N // 4, N)]
    flash_small, _, flash, fused = peaks
    assert flash_small == flash and fused - flash >= 4 * ROWS * N


def launches(compute, tokens: int, count: int = 1):
    """Kernels of one forward + backward of `count` Pattentions of one input (τ ≠ 1), the token counts given as
    the layer's buffers are. fp32: bf16 launches the same kernels, and the interpreter emulates bf16 slowly."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE)

    x = randn(tokens, 16).requires_grad_()
    keys, values = ([randn(16, 16).requires_grad_() for _ in range(count)] for _ in "kv")
    counts = [torch.tensor(n, device=DEVICE) for n in (16, 30, 20)[:count]]
    upstream = randn(count, tokens, 16)
    return device_launches(lambda: compute(x, keys, values, "l2_norm_gelu", TAU, counts).backward(upstream))


def test_one_forward_and_backward_launches_as_many_kernels_at_16384_tokens_as_at_2048_and_at_most_fused_plus_3(
        monkeypatch):
    """benchmarks/launches.py counts Triton's launches and the aten operators that launch a device kernel. Row
    tiles of 2048 (the count does not depend on the tiles; on a CPU the interpreter runs every program in
    Python): one row tile at 2,048 tokens, eight at 16,384, where a host loop over row tiles would launch eight
    times as much. Fused as CUDA runs it (its Θ in tiles_triton's kernels) is one node with no loop over rows,
    its launches the same at any token count: counted at 64 and 128 tokens. One Pattention, and attention's
    three of one input (Q, K, V: their dX summed in the kernels)."""
    monkeypatch.setitem(flash_triton.TILES, DEVICE if DEVICE == "cpu" else "default",
                        flash_triton.Tiles(2048, 16, 16, 16))
    flash, fused = pattentions_function("flash", "kernels"), pattentions_function("fused", "triton")
    one = [launches(flash, tokens) for tokens in (2048, 16384)]
    assert one[0] == one[1]
    for count, flashed in ((1, one[0]), (3, launches(flash, 2048, count=3))):
        by_fused = [launches(fused, tokens, count) for tokens in (64, 128)]
        assert by_fused[0] == by_fused[1] and flashed.total <= by_fused[0].total + 3, (count, flashed, by_fused[0])


def test_only_the_kernels_backend_runs_the_kernels_and_auto_on_cuda_runs_the_blocks(monkeypatch):
    """flash_backend kernels runs flash_triton's kernels for the l2 Θ; triton, and auto on CUDA (which resolves to
    triton), run flash's blocks of rows with Triton tiles, computing the same values: the kernels trained 44x
    slower than fused on an H200 (benchmarks/RESULTS.md), so no default reaches them."""
    from megatron.model.pattention.registry import resolved_backend

    calls = []
    kernels = flash_triton.flash_kernel_pattentions
    monkeypatch.setattr(flash_triton, "flash_kernel_pattentions", lambda *args: calls.append(args) or kernels(*args))
    x, keys, values = inputs()
    outputs = {}
    for backend in ("triton", "kernels"):
        calls.clear()
        outputs[backend] = pattentions_function("flash", backend)(x.float(), [k.float() for k in keys],
                                                                  [v.float() for v in values], "l2_norm_gelu", TAU,
                                                                  COUNTS)
        assert len(calls) == (backend == "kernels"), backend
    assert resolved_backend("auto", torch.device("cuda")) == "triton"
    torch.testing.assert_close(outputs["triton"], outputs["kernels"], rtol=0,
                               atol=1e-5 * outputs["triton"].abs().max().item())
