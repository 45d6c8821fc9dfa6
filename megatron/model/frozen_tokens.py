"""Keep a Pattention's leading parameter tokens fixed in training (freeze_old_param_tokens, after growth).

Zeroing their gradients would not be enough: AdamW's decoupled weight decay shrinks every row it holds,
and momentum keeps moving rows whose gradient has become zero. So the frozen rows leave the optimizer.
Of a layer's token matrices (`key_param_tokens`, `value_param_tokens`: this tensor-parallel rank's block
[start, start + n) of the layer's tokens, mpu/sharding.py), the rows below the layer-wide count f move into
a buffer; per rank that is min(max(f − start, 0), n) rows:

    none   the matrix stays a parameter;
    all    it becomes a buffer of the same name (so no zero-row parameter reaches DeepSpeed);
    some   it becomes a parametrization (torch.nn.utils.parametrize), computed in every forward as
           cat(frozen rows: a buffer, trainable rows: the parameter `parametrizations.<matrix>.original`,
           which keeps the matrix's tensor-parallel split).

Code reading `layer.key_param_tokens` is unchanged. state_dict and load_state_dict of a frozen layer have
exactly the unfrozen layer's entries and shapes, so checkpoint weights, inference and the grow tool see no
difference; only the optimizer state (and ZeRO's parameter names beside it) covers just the trainable rows.

The frozen rows are held in the dtype the run trains in (`dtype`; DeepSpeed casts parameters, not buffers,
to bf16). A bf16 run therefore holds them in bf16 with no fp32 master copy (the optimizer keeps masters only
of what it trains): they stay bit-identical in bf16, and whatever reads the checkpoint afterwards gets them
at bf16 precision.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from megatron.model.pattention import Pattention
from megatron.mpu import is_split
from megatron.mpu.sharding import block_start

TOKEN_MATRICES = ("key_param_tokens", "value_param_tokens")


class _AfterFrozenRows(nn.Module):
    """Parametrization: trainable rows -> the whole matrix, the frozen rows (a buffer) first."""

    def __init__(self, frozen_rows: Tensor) -> None:
        super().__init__()
        self.register_buffer("frozen", frozen_rows)

    def forward(self, trainable: Tensor) -> Tensor:
        return torch.cat([self.frozen, trainable])

    def right_inverse(self, whole: Tensor) -> Tensor:
        return whole[len(self.frozen):].clone()


def frozen_rows(layer: Pattention, frozen_tokens: int) -> int:
    """How many rows of this rank's block of `layer` lie below the layer-wide token index `frozen_tokens`."""
    tokens = layer.key_param_tokens
    start = block_start(len(tokens)) if is_split(tokens) else 0
    return min(max(frozen_tokens - start, 0), len(tokens))


def freeze_leading_tokens(layer: Pattention, frozen_tokens: int, dtype: torch.dtype) -> None:
    """Take the layer's first `frozen_tokens` tokens (counted over all its tensor-parallel blocks) out of
    training, held in `dtype`; call before the optimizer is built."""
    rows = frozen_rows(layer, frozen_tokens)
    for name in TOKEN_MATRICES:
        tokens = getattr(layer, name).detach()
        if rows == len(tokens):
            delattr(layer, name)
            layer.register_buffer(name, tokens.to(dtype))
        elif rows:
            parametrize.register_parametrization(layer, name, _AfterFrozenRows(tokens[:rows].to(dtype, copy=True)))
    if 0 < rows < len(layer.key_param_tokens):
        layer.register_state_dict_post_hook(_whole_matrices)
        layer.register_load_state_dict_pre_hook(_split_matrices)


def _parts(prefix: str, name: str) -> tuple[str, str]:
    """state_dict names of a parametrized matrix's frozen and trainable rows."""
    return f"{prefix}parametrizations.{name}.0.frozen", f"{prefix}parametrizations.{name}.original"


def _whole_matrices(layer: Pattention, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    for name in TOKEN_MATRICES:
        frozen, trainable = (state_dict.pop(key) for key in _parts(prefix, name))
        state_dict[prefix + name] = torch.cat([frozen.detach(), trainable.detach()])


def _split_matrices(layer: Pattention, state_dict: dict, prefix: str, *_) -> None:
    for name in TOKEN_MATRICES:
        if prefix + name in state_dict:
            whole = state_dict.pop(prefix + name)
            rows = len(layer.parametrizations[name][0].frozen)
            frozen_key, trainable_key = _parts(prefix, name)
            state_dict[frozen_key], state_dict[trainable_key] = whole[:rows], whole[rows:]
