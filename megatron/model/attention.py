"""Causal multi-head self-attention whose Q, K, V and output projections are Pattentions.

Submodule names follow the official release: `query`, `key`, `value` (qkv_slot_num tokens each) and
`proj` (proj_slot_num tokens), all hidden_size -> hidden_size.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron.model.args import TokenFormerArgs
from megatron.model.pattention import Pattention
from megatron.model.rotary import apply_rotary, rotary_cos_sin


class SelfAttention(nn.Module):
    """x [b, s, d] -> [b, s, d]; scores scaled by 1/√head_dim, rotary on the first `rotary_dims` of each head."""

    def __init__(self, args: TokenFormerArgs, device: str | torch.device | None = None) -> None:
        super().__init__()
        d = args.hidden_size

        def make_pattention(num_tokens: int) -> Pattention:
            return Pattention(d, d, num_tokens, args.norm_activation_type, args.pattention_tau, device=device)

        self.query = make_pattention(args.qkv_slot_num)
        self.key = make_pattention(args.qkv_slot_num)
        self.value = make_pattention(args.qkv_slot_num)
        self.proj = make_pattention(args.proj_slot_num)
        self.num_heads = args.num_attention_heads
        self.head_dim = args.head_dim
        self.rotary_dims = args.rotary_dims
        self.rotary_base = args.rotary_emb_base
        self.attention_dropout = args.attention_dropout

    def _split_heads(self, x: Tensor) -> Tensor:
        batch, seq, _ = x.shape
        return x.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: Tensor) -> Tensor:
        query, key, value = (self._split_heads(p(x)) for p in (self.query, self.key, self.value))
        if self.rotary_dims:
            cos, sin = rotary_cos_sin(x.shape[1], self.rotary_dims, self.rotary_base, x.device)
            query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
        context = F.scaled_dot_product_attention(
            query, key, value, dropout_p=self.attention_dropout if self.training else 0.0, is_causal=True)
        return self.proj(context.transpose(1, 2).flatten(2))
