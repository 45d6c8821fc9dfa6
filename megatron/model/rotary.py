"""Rotary position embeddings in the GPT-NeoX convention (rotate-half, partial rotation).

The first `rotary_dims` dims of each head are split into two halves (x1, x2) and rotated as
x·cos + rotate_half(x)·sin with rotate_half(x) = (−x2, x1), frequencies 1 / base^(2i / rotary_dims);
the remaining dims pass through unchanged. cos/sin are computed in fp32 on the fly (no buffer to restore
after building on the meta device) and cast to the input dtype, as GPT-NeoX does.
"""

import torch
from torch import Tensor


def rotary_cos_sin(seq_len: int, rotary_dims: int, base: float, device: torch.device) -> tuple[Tensor, Tensor]:
    """cos and sin tables [seq_len, rotary_dims] for positions 0..seq_len-1."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dims, 2, device=device, dtype=torch.float32) / rotary_dims))
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def _rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first cos.shape[-1] dims of x [..., seq, head_dim] by position (dim -2); the rest pass."""
    rotary_dims = cos.shape[-1]
    rotated, passed = x[..., :rotary_dims], x[..., rotary_dims:]
    rotated = rotated * cos.to(x.dtype) + _rotate_half(rotated) * sin.to(x.dtype)
    return torch.cat((rotated, passed), dim=-1)
