"""Checks the Pattention implementations' tests share (tests/test_fused_pattention.py, test_flash_pattention.py)."""

from collections.abc import Callable

import torch
import torch.distributed as dist


def all_reduce_of(op: dist.ReduceOp.RedOpType) -> Callable[[torch.Tensor], torch.Tensor]:
    """A plain (non-autograd) all-reduce over the world, as a node's `reduce_sum` / `reduce_max`."""
    def reduce(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t, op=op)
        return t
    return reduce


def assert_zero_key_growth_is_bit_identical(several_pattentions: Callable, norm_type: str, tokens: int,
                                            grown: int) -> None:
    """Three Pattentions of one input, d_in = d_out = 64, grown from `tokens` to `grown` tokens with zero keys
    and the old n: the output, dX and the old tokens' gradients must keep every bit (fp32)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, 64, generator=g)
    keys = [torch.randn(tokens, 64, generator=g) * 0.1 for _ in range(3)]
    values = [torch.randn(tokens, 64, generator=g) * 0.1 for _ in range(3)]
    new_values = [torch.randn(grown - tokens, 64, generator=g) * 0.1 for _ in range(3)]
    upstream = torch.randn(3, 4, 64, 64, generator=g)

    def run(keys, values):
        params = [t.clone().requires_grad_() for t in keys + values]
        x_leaf = x.clone().requires_grad_()
        out = several_pattentions(x_leaf, params[:3], params[3:], norm_type, 1.0, [tokens] * 3)
        (out * upstream).sum().backward()
        return out.detach(), x_leaf.grad, [p.grad[:tokens] for p in params]

    out, grad_x, grads = run(keys, values)
    grown_out, grown_grad_x, grown_grads = run([torch.cat([k, torch.zeros_like(v)]) for k, v in zip(keys, new_values)],
                                               [torch.cat([v, w]) for v, w in zip(values, new_values)])
    assert torch.equal(grown_out, out) and torch.equal(grown_grad_x, grad_x)
    assert all(torch.equal(a, b) for a, b in zip(grown_grads, grads))
