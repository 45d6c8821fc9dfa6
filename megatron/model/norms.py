"""Layer norms: the parameter-free one TokenFormer blocks use, and the affine one of the final norm.

`layernorm_nonparam` (official LayerNorm_NonParam) is F.layer_norm without weight or bias, so it adds
no state_dict entries; `layernorm` is torch's LayerNorm (weight, bias) initialised to ones/zeros.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron.model.init_roles import InitRole


class NonParametricLayerNorm(nn.Module):
    """Normalise the last dim to zero mean and unit variance, with no learnable scale or shift."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, (self.hidden_size,), eps=self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


class AffineLayerNorm(nn.LayerNorm):
    """torch's LayerNorm, declaring its init roles (weight ones, bias zeros) for `initialize_parameters`."""

    def init_roles(self) -> dict[str, InitRole]:
        return {"weight": InitRole.ONES, "bias": InitRole.ZEROS}


def make_layer_norm(kind: str, hidden_size: int, eps: float,
                    device: str | torch.device | None = None) -> nn.Module:
    """`kind` is the config value: "layernorm_nonparam" or "layernorm"."""
    if kind == "layernorm_nonparam":
        return NonParametricLayerNorm(hidden_size, eps)
    if kind == "layernorm":
        return AffineLayerNorm(hidden_size, eps=eps, device=device)
    raise ValueError(f"norm={kind!r}: must be 'layernorm_nonparam' or 'layernorm'")
