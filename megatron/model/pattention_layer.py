"""The Pattention layer: n key/value parameter tokens, computed by the implementation the config picks.

    plain   pattention.pattention under autograd: the reference formula
    fused   pattention.fused_pattentions: one node keeping one [tokens, n] score matrix for backward
    flash   flash_pattention.flash_pattentions: tiles, keeping the input and O(tokens) statistics

All three take the same arguments, including the reductions tensor parallelism passes for the row
statistics (parallel_pattention.py), and compute the same values and gradients.
"""

from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import Tensor, nn

from megatron.model.args import FLASH_BACKENDS, PATTENTION_IMPLS
from megatron.model.flash_pattention import flash_pattentions
from megatron.model.init_methods import InitRole
from megatron.model.pattention import Reduce, _check_norm_type, _unchanged, fused_pattentions, plain_pattentions


def pattentions_function(impl: str, flash_backend: str = "auto") -> Callable[..., Tensor]:
    """The function computing several Pattentions of one input by implementation `impl`: called as
    f(x, key_tokens, value_tokens, norm_type, tau, norm_token_counts, reduce_sum, reduce_max) -> [B, ..., d_out]."""
    if impl == "flash":
        return partial(flash_pattentions, backend=flash_backend)
    implementations = {"fused": fused_pattentions, "plain": plain_pattentions}
    if impl not in implementations:
        raise ValueError(f"pattention_impl={impl!r}: must be one of {PATTENTION_IMPLS}")
    return implementations[impl]


class Pattention(nn.Module):
    """A Pattention layer d_in -> d_out with `num_tokens` key/value parameter tokens.

    Parameters `key_param_tokens` [n, d_in] and `value_param_tokens` [n, d_out] keep the official names;
    they are left uninitialised here (see `initialize_parameters`). `norm_token_count` (int64, saved in
    the state_dict) is the n of √n / ·n: `num_tokens` unless given (a tensor-parallel block holds fewer
    tokens than the layer it normalises as). `impl` and `flash_backend` choose how it is computed.
    """

    def __init__(
        self,
        input_dim: int,
        output_dim: int,
        num_tokens: int,
        norm_type: str,
        tau: float = 1.0,
        device: str | torch.device | None = None,
        norm_token_count: int | None = None,
        impl: str = "flash",
        flash_backend: str = "auto",
    ) -> None:
        super().__init__()
        _check_norm_type(norm_type)
        if impl not in PATTENTION_IMPLS:
            raise ValueError(f"pattention_impl={impl!r}: must be one of {PATTENTION_IMPLS}")
        if flash_backend not in FLASH_BACKENDS:
            raise ValueError(f"flash_backend={flash_backend!r}: must be one of {FLASH_BACKENDS}")
        self.norm_type = norm_type
        self.tau = tau
        self.impl = impl
        self.flash_backend = flash_backend
        self.key_param_tokens = nn.Parameter(torch.empty(num_tokens, input_dim, device=device))
        self.value_param_tokens = nn.Parameter(torch.empty(num_tokens, output_dim, device=device))
        self.register_buffer("norm_token_count",
                             torch.tensor(num_tokens if norm_token_count is None else norm_token_count,
                                          dtype=torch.int64, device=device))

    def init_roles(self) -> dict[str, InitRole]:
        """Official init: keys use `init_method`, values use `output_layer_init_method`."""
        return {"key_param_tokens": InitRole.INPUT, "value_param_tokens": InitRole.OUTPUT}

    def run(self, layers: Sequence["Pattention"], x: Tensor, reduce_sum: Reduce = _unchanged,
            reduce_max: Reduce = _unchanged) -> Tensor:
        """`layers` (this one's settings; equal shapes) on the same input x: [len(layers), ..., d_out]."""
        compute = pattentions_function(self.impl, self.flash_backend)
        return compute(x, [p.key_param_tokens for p in layers], [p.value_param_tokens for p in layers], self.norm_type,
                       self.tau, [p.norm_token_count for p in layers], reduce_sum, reduce_max)

    def forward(self, x: Tensor) -> Tensor:
        return self.run([self], x).squeeze(0)

    def extra_repr(self) -> str:
        n, d_in = self.key_param_tokens.shape
        return (f"{d_in} -> {self.value_param_tokens.shape[1]}, tokens={n}, norm={self.norm_type}, tau={self.tau}, "
                f"impl={self.impl}")
