"""Causal multi-head self-attention whose Q, K, V and output projections are Pattentions.

Submodule names follow the official release: `query`, `key`, `value` (qkv_slot_num tokens each) and
`proj` (proj_slot_num tokens), all hidden_size -> hidden_size.

Q, K and V are three Pattentions of the same input, computed in one node of the configured implementation
(fused or flash: outputs written straight into one [3, b, s, d] tensor, X's gradient accumulated in place);
splitting them into heads and rotating Q and K is one more node (`_Heads`). docs/performance.md says why.

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
from megatron.model.declared_pattentions import add_declared_pattentions
from megatron.model.kv_cache import LayerKVCache, causal_mask
from megatron.model.rotary import apply_rotary, rotary_cos_sin
from megatron.mpu import (
    all_gather_to_region,
    copy_to_region,
    reduce_from_region,
    reduce_scatter_to_region,
    split_region_rng,
    split_size,
)


class SelfAttention(nn.Module):
    """Replicated x [b, s, d] -> replicated [b, s, d]; scores scaled by 1/√head_dim, rotary on the first
    `rotary_dims` of each head; this rank computes num_attention_heads / model_parallel_size heads."""

    def __init__(self, args: TokenFormerArgs, device: str | torch.device | None = None) -> None:
        super().__init__()
        self._add_projections(args, device)
        self.num_local_heads = split_size(args.num_attention_heads, "num_attention_heads")
        self.rotary_dims = args.rotary_dims
        self.rotary_base = args.rotary_emb_base
        self.attention_dropout = args.attention_dropout

    def _add_projections(self, args: TokenFormerArgs, device: str | torch.device | None) -> None:
        add_declared_pattentions(self, "attention", args, device)  # query, key, value, proj (spec.py)

    def _partial_qkv(self, x: Tensor) -> Tensor:
        """This rank's shares of Q, K and V for x [b, s, d]: [3, b, s, d]."""
        return self.query.run_split([self.query, self.key, self.value], x)

    def _local_heads(self, x: Tensor, cos: Tensor | None, sin: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """Replicated x [b, s, d] -> this rank's heads of Q, K, V, each [b, heads / tp, s, head_dim], rotated."""
        qkv = reduce_scatter_to_region(self._partial_qkv(copy_to_region(x)), dim=-1)  # [3, b, s, d / tp]
        return _Heads.apply(qkv, self.num_local_heads, cos, sin)

    def _output(self, context: Tensor) -> Tensor:
        """This rank's heads' context [b, s, d / tp] -> the replicated output [b, s, d]."""
        return reduce_from_region(self.proj.partial_output(all_gather_to_region(context, dim=-1)))

    def forward(self, x: Tensor, cache: LayerKVCache | None = None) -> Tensor:
        """With a `cache`, x holds the tokens after the cached ones: they attend to those too."""
        past = 0 if cache is None else cache.length
        cos = sin = None
        if self.rotary_dims:
            cos, sin = rotary_cos_sin(past + x.shape[1], self.rotary_dims, self.rotary_base, x.device)
            cos, sin = cos[past:], sin[past:]
        query, key, value = self._local_heads(x, cos, sin)
        if cache is not None:
            key, value = cache.extend(key, value)
        mask = causal_mask(query.shape[2], key.shape[2], x.device) if past else None
        with split_region_rng():
            context = F.scaled_dot_product_attention(
                query, key, value, attn_mask=mask, dropout_p=self.attention_dropout if self.training else 0.0,
                is_causal=mask is None)
        return self._output(context.transpose(1, 2).flatten(2))


class _Heads(torch.autograd.Function):
    """Q, K, V [3, b, s, heads·head_dim] -> each [b, heads, s, head_dim], Q and K rotated unless cos is None.

    Backward writes the three gradients into one [3, b, s, d] tensor, Q's and K's rotated back (by −θ);
    autograd's own backward of the views, slices and rotation would zero-fill, add and copy it several times.
    """

    @staticmethod
    def forward(ctx, qkv, num_heads, cos, sin):
        heads = qkv.unflatten(-1, (num_heads, -1)).transpose(-3, -2)
        query_key = heads[:2] if cos is None else apply_rotary(heads[:2], cos, sin)
        ctx.save_for_backward(cos, sin)
        ctx.shape, ctx.num_heads = qkv.shape, num_heads
        return query_key[0], query_key[1], heads[2]

    @staticmethod
    def backward(ctx, grad_query, grad_key, grad_value):
        cos, sin = ctx.saved_tensors
        grad = grad_value.new_empty(ctx.shape)
        heads = grad.unflatten(-1, (ctx.num_heads, -1)).transpose(-3, -2)
        for i, g in enumerate((grad_query, grad_key)):
            if cos is None:
                heads[i].copy_(g)
            else:
                apply_rotary(g, cos, -sin, out=heads[i])
        heads[2].copy_(grad_value)
        return grad, None, None, None
