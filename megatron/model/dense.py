"""The dense Transformer baseline (`model_type: transformer`): GPT-NeoX's layer with linear projections where
TokenFormer has Pattentions, in the same model, norms, rotary, vocabulary and trainer, so that the paper's
comparison (a Transformer trained from scratch against TokenFormer grown) runs in one framework.

    attention.query_key_value  [3d, d] + bias, column-parallel; output laid out per head as GPT-NeoX's,
                               [heads, (q, k, v), head_dim], so that each tensor rank holds whole heads
    attention.dense            [d, d] + bias, row-parallel (its partial products all-reduced)
    mlp.dense_h_to_4h          [4d, d] + bias, column-parallel;  GeLU
    mlp.dense_4h_to_h          [d, 4d] + bias, row-parallel

Names are GPT-NeoX's (and Hugging Face's GPTNeoX); weights use `init_method`, the two output layers
`output_layer_init_method`, biases start at zero, as in GPT-NeoX.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron.model.args import TokenFormerArgs
from megatron.model.attention import SelfAttention, _Heads
from megatron.model.init_roles import InitRole
from megatron.mpu import ColumnParallelLinear, RowParallelLinear

_ROLES = {"weight": InitRole.INPUT, "bias": InitRole.ZEROS}
_OUTPUT_ROLES = {"weight": InitRole.OUTPUT, "bias": InitRole.ZEROS}


class DenseSelfAttention(SelfAttention):
    """SelfAttention with Megatron's column/row-parallel linear projections instead of Pattentions: no collective
    before the heads, one all-reduce after the output layer."""

    def _add_projections(self, args: TokenFormerArgs, device: str | torch.device | None) -> None:
        d = args.hidden_size
        self.query_key_value = ColumnParallelLinear(d, 3 * d, device=device)
        self.dense = RowParallelLinear(d, d, device=device)

    def init_roles(self) -> dict[str, InitRole]:
        return {**{f"query_key_value.{k}": r for k, r in _ROLES.items()},
                **{f"dense.{k}": r for k, r in _OUTPUT_ROLES.items()}}

    def _local_heads(self, x: Tensor, cos: Tensor | None, sin: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        qkv = self.query_key_value(x).unflatten(-1, (self.num_local_heads, 3, -1))  # [b, s, heads, 3, head_dim]
        return _Heads.apply(qkv.permute(3, 0, 1, 2, 4).flatten(-2), self.num_local_heads, cos, sin)

    def _output(self, context: Tensor) -> Tensor:
        return self.dense(context)


class DenseMLP(nn.Module):
    """x [b, s, d] -> dense_4h_to_h(GeLU(dense_h_to_4h(x))), the 4d hidden features split over tensor ranks."""

    def __init__(self, args: TokenFormerArgs, device: str | torch.device | None = None) -> None:
        super().__init__()
        d = args.hidden_size
        self.dense_h_to_4h = ColumnParallelLinear(d, 4 * d, device=device)
        self.dense_4h_to_h = RowParallelLinear(4 * d, d, device=device)

    def init_roles(self) -> dict[str, InitRole]:
        return {**{f"dense_h_to_4h.{k}": r for k, r in _ROLES.items()},
                **{f"dense_4h_to_h.{k}": r for k, r in _OUTPUT_ROLES.items()}}

    def forward(self, x: Tensor) -> Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))
