"""One pre-norm TokenFormer block: token-token attention, then a Pattention "FFN".

    x = x + Dropout(Attention(input_layernorm(x)))
    x = x + Dropout(mlp(post_attention_layernorm(x)))     # mlp: Pattention d -> d, ffn_slot_num tokens

With `model_type: transformer` the same block holds GPT-NeoX's linear attention projections and 4d-wide MLP
instead (dense.py).

Submodule names (`input_layernorm`, `attention`, `post_attention_layernorm`, `mlp`) match the official
release.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron.model.args import TokenFormerArgs
from megatron.model.attention import SelfAttention
from megatron.model.declared_pattentions import add_declared_pattentions, check_declared_pattentions
from megatron.model.dense import DenseMLP, DenseSelfAttention
from megatron.model.kv_cache import LayerKVCache
from megatron.model.norms import make_layer_norm


class TokenFormerLayer(nn.Module):
    """x [b, s, d] -> [b, s, d], replicated on every tensor-parallel rank (dropout here draws the same
    masks on all of them)."""

    def __init__(self, args: TokenFormerArgs, device: str | torch.device | None = None) -> None:
        super().__init__()
        d = args.hidden_size
        self.input_layernorm = make_layer_norm(args.norm, d, args.layernorm_epsilon, device)
        dense = args.model_type == "transformer"
        self.attention = (DenseSelfAttention if dense else SelfAttention)(args, device)
        self.post_attention_layernorm = make_layer_norm(args.norm, d, args.layernorm_epsilon, device)
        if dense:
            self.mlp = DenseMLP(args, device)
        else:
            add_declared_pattentions(self, "", args, device)  # mlp (spec.py)
            check_declared_pattentions(self)
        self.hidden_dropout = args.hidden_dropout

    def forward(self, x: Tensor, cache: LayerKVCache | None = None) -> Tensor:
        x = x + F.dropout(self.attention(self.input_layernorm(x), cache), self.hidden_dropout, self.training)
        return x + F.dropout(self.mlp(self.post_attention_layernorm(x)), self.hidden_dropout, self.training)
