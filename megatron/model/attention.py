"""Causal multi-head self-attention whose Q, K, V and output projections are Pattentions.

Submodule names follow the official release: `query`, `key`, `value` (qkv_slot_num tokens each) and
`proj` (proj_slot_num tokens), all hidden_size -> hidden_size.

Tensor parallelism (docs/tensor_parallel.md): every Pattention is split by parameter tokens, the heads
by rank. Q, K and V leave their Pattentions as per-rank partial sums; one reduce-scatter along the
hidden dimension both sums them and hands each rank its own heads (heads are contiguous in it).
Attention runs on the local heads; their context is all-gathered because `proj` needs every head, and
`proj`'s partial outputs are all-reduced into the replicated residual stream.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron.model.args import TokenFormerArgs
from megatron.model.kv_cache import LayerKVCache, causal_mask
from megatron.model.parallel_pattention import ParallelPattention
from megatron.model.rotary import apply_rotary, rotary_cos_sin
from megatron.mpu import (all_gather_to_region, copy_to_region, reduce_from_region, reduce_scatter_to_region,
                          split_region_rng, split_size)


class SelfAttention(nn.Module):
    """Replicated x [b, s, d] -> replicated [b, s, d]; scores scaled by 1/√head_dim, rotary on the first
    `rotary_dims` of each head; this rank computes num_attention_heads / model_parallel_size heads."""

    def __init__(self, args: TokenFormerArgs, device: str | torch.device | None = None) -> None:
        super().__init__()
        d = args.hidden_size

        def make_pattention(num_tokens: int) -> ParallelPattention:
            return ParallelPattention(d, d, num_tokens, args.norm_activation_type, args.pattention_tau, device=device)

        self.query = make_pattention(args.qkv_slot_num)
        self.key = make_pattention(args.qkv_slot_num)
        self.value = make_pattention(args.qkv_slot_num)
        self.proj = make_pattention(args.proj_slot_num)
        self.num_local_heads = split_size(args.num_attention_heads, "num_attention_heads")
        self.head_dim = args.head_dim
        self.rotary_dims = args.rotary_dims
        self.rotary_base = args.rotary_emb_base
        self.attention_dropout = args.attention_dropout

    def _split_heads(self, x: Tensor) -> Tensor:
        """[b, s, local_heads·head_dim] -> [b, local_heads, s, head_dim]."""
        return x.unflatten(-1, (self.num_local_heads, self.head_dim)).transpose(1, 2)

    def forward(self, x: Tensor, cache: LayerKVCache | None = None) -> Tensor:
        """With a `cache`, x holds the tokens after the cached ones: they attend to those too."""
        x = copy_to_region(x)
        partial_qkv = torch.stack([p.partial_output(x) for p in (self.query, self.key, self.value)], dim=2)
        qkv = reduce_scatter_to_region(partial_qkv, dim=-1)  # [b, s, 3, d / tp]: this rank's heads
        query, key, value = (self._split_heads(t) for t in qkv.unbind(dim=2))
        past = 0 if cache is None else cache.length
        if self.rotary_dims:
            cos, sin = rotary_cos_sin(past + x.shape[1], self.rotary_dims, self.rotary_base, x.device)
            query, key = apply_rotary(query, cos[past:], sin[past:]), apply_rotary(key, cos[past:], sin[past:])
        if cache is not None:
            key, value = cache.extend(key, value)
        mask = causal_mask(query.shape[2], key.shape[2], x.device) if past else None
        with split_region_rng():
            context = F.scaled_dot_product_attention(
                query, key, value, attn_mask=mask, dropout_p=self.attention_dropout if self.training else 0.0,
                is_causal=mask is None)
        context = all_gather_to_region(context.transpose(1, 2).flatten(2), dim=-1)
        return reduce_from_region(self.proj.partial_output(context))
