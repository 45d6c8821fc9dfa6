"""Rotary position embeddings in the GPT-NeoX convention (rotate-half, partial rotation).

The first `rotary_dims` dims of each head are split into two halves (x1, x2) and rotated as
x·cos + rotate_half(x)·sin with rotate_half(x) = (−x2, x1), frequencies 1 / base^(2i / rotary_dims);
the remaining dims pass through unchanged. Both halves use the same angles, so the tables hold one half
(rotary_dims / 2 columns). The rotation is written straight into its output, without the temporaries
and concatenations of the textbook form; its gradient is the rotation by −θ (`sin` negated), which
attention's autograd node applies (megatron/model/attention.py). cos/sin are computed in fp32 on the fly
(no buffer to restore after building on the meta device) and cast to the input dtype, as GPT-NeoX does.
"""

import torch
from torch import Tensor


def rotary_cos_sin(seq_len: int, rotary_dims: int, base: float, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos and sin tables [seq_len, rotary_dims / 2] for positions 0..seq_len-1."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dims, 2, device=device, dtype=torch.float32) / rotary_dims))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, out: Tensor | None = None) -> Tensor:
    """Rotate the first 2·cos.shape[-1] dims of x [..., seq, head_dim] by position (dim -2); the rest pass.

    Writes into `out` (x's shape, any strides) when given. Not differentiable itself (out= writes).
    """
    half = cos.shape[-1]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    first, second = x[..., :half], x[..., half:2 * half]
    if torch.compiler.is_compiling():  # torch.compile traces no out= into strided views; it fuses this anyway
        rotated = torch.cat([torch.addcmul(first * cos, second, sin, value=-1),
                             torch.addcmul(second * cos, first, sin), x[..., 2 * half:]], dim=-1)
        return rotated if out is None else out.copy_(rotated)
    out = torch.empty_like(x) if out is None else out
    out_first, out_second = out[..., :half], out[..., half:2 * half]
    torch.mul(first, cos, out=out_first).addcmul_(second, sin, value=-1)
    torch.mul(second, cos, out=out_second).addcmul_(first, sin)
    out[..., 2 * half:] = x[..., 2 * half:]
    return out
