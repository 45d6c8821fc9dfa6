"""TokenFormer (Wang et al., ICLR 2025) as a Hugging Face `transformers` (5.x) causal language model.

    model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

`tools/convert_to_hf.py` copies this file into the directories it writes, so it imports `torch` and `transformers`
only, never the training framework; it computes the framework's function (megatron/model/) from the same
weights, in the same order of operations where that decides the rounding, so that greedy decoding picks the
same tokens:

    Pattention(X) = Θ(τ · X · K_Pᵀ) · V_P, Θ over the n parameter tokens of each row of scores A:
        l2_norm_gelu  GeLU(A / ‖A‖₂ · √n)    gelu_l2_norm  GeLU(A) / ‖GeLU(A)‖₂ · √n    softmax  softmax(A) · n
    n is the layer's `norm_token_count` (config `norm_token_counts`): a grown model keeps its old n.
    block: x += Attention(LN(x)); x += Pattention_mlp(LN(x)); LN parameter-free unless `norm` is "layernorm"
    attention: Q, K, V, proj are Pattentions; rotary (GPT-NeoX rotate-half) on the first rotary_pct of each head
    logits = final_norm(x) · Eᵀ (tied) or · lm_headᵀ

Statistics and Θ are computed in at least fp32, as in training. Keys and values are cached after rotary in a
`transformers` `Cache` (a `DynamicCache` by default), so `generate` works with greedy search, sampling and beams.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_tokenformer import TokenFormerConfig

# Floor on a row's squared L2 norm: an all-zero row gives zero weights instead of NaN (as in training).
ZERO_ROW_GUARD = 1e-12


def pattention(x: Tensor, keys: Tensor, values: Tensor, norm_type: str, tau: float, n: int) -> Tensor:
    """Θ(τ · x · keysᵀ) · values for x [..., d_in] -> [..., d_out]."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    if tau != 1.0:
        x = x * tau
    scores = torch.mm(x, keys.t())
    a = scores.to(torch.promote_types(scores.dtype, torch.float32))
    count = torch.tensor(n, dtype=a.dtype, device=a.device)
    if norm_type == "softmax":
        weights = torch.exp(a - a.amax(dim=-1, keepdim=True))
        out = torch.mm(weights.to(x.dtype), values).mul_(count / weights.sum(dim=-1, keepdim=True))
    else:
        activated = F.gelu(a) if norm_type == "gelu_l2_norm" else a
        statistic = torch.linalg.vector_norm(activated, dim=-1, keepdim=True).square()
        row = torch.rsqrt(statistic.clamp(min=ZERO_ROW_GUARD)).mul(count.sqrt())
        if norm_type == "gelu_l2_norm":
            out = torch.mm(activated.to(x.dtype), values).mul_(row)
        else:
            out = torch.mm(F.gelu(a * row).to(x.dtype), values)
    return out.view(*shape[:-1], values.shape[-1])


class TokenFormerPattention(nn.Module):
    """A Pattention d -> d: `num_tokens` key/value parameter tokens, normalised with n = `norm_token_count`."""

    def __init__(self, config: TokenFormerConfig, num_tokens: int, norm_token_count: int) -> None:
        super().__init__()
        d = config.hidden_size
        self.key_param_tokens = nn.Parameter(torch.empty(num_tokens, d))
        self.value_param_tokens = nn.Parameter(torch.empty(num_tokens, d))
        self.norm_type, self.tau, self.norm_token_count = config.norm_activation_type, config.pattention_tau, \
            norm_token_count

    def forward(self, x: Tensor) -> Tensor:
        return pattention(x, self.key_param_tokens, self.value_param_tokens, self.norm_type, self.tau,
                          self.norm_token_count)


def add_pattentions(owner: nn.Module, parent: str, config: TokenFormerConfig, layer_idx: int) -> None:
    """Add to `owner`, the module at `parent` inside layer `layer_idx` ("" for the layer), each Pattention
    config.json places there (`pattention_paths`, megatron/model/spec.py's): the weights of one this code does not
    compute with are then kept by from_pretrained and save_pretrained, not dropped as unexpected."""
    for name, path in config.pattention_paths.items():
        module_parent, _, attribute = path.rpartition(".")
        if module_parent == parent:
            owner.add_module(attribute, TokenFormerPattention(config, config.slot_num(name),
                                                              config.norm_token_count(layer_idx, name)))


class NonParametricLayerNorm(nn.Module):
    """LayerNorm without scale or shift (the blocks' norm in TokenFormer)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, (self.hidden_size,), eps=self.eps)


def layer_norm(kind: str, config: TokenFormerConfig) -> nn.Module:
    if kind == "layernorm":
        return nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
    return NonParametricLayerNorm(config.hidden_size, config.layernorm_epsilon)


def rotary_cos_sin(position_ids: Tensor, rotary_dims: int, base: float) -> tuple[Tensor, Tensor]:
    """cos, sin [batch, 1, seq, rotary_dims / 2] of the angles position · base^(-2i / rotary_dims), in fp32."""
    exponents = torch.arange(0, rotary_dims, 2, device=position_ids.device, dtype=torch.float32) / rotary_dims
    inverse_frequencies = 1.0 / (base ** exponents)
    angles = position_ids[:, None, :, None].float() * inverse_frequencies
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """GPT-NeoX rotate-half on the first 2·cos.shape[-1] dims of x [batch, heads, seq, head_dim]; the rest pass."""
    half = cos.shape[-1]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    first, second = x[..., :half], x[..., half:2 * half]
    return torch.cat((torch.mul(first, cos).addcmul_(second, sin, value=-1),
                      torch.mul(second, cos).addcmul_(first, sin), x[..., 2 * half:]), dim=-1)


def position_ids_for(position_ids: Tensor | None, attention_mask: Tensor | None, past: int, length: int,
                     device: torch.device) -> Tensor:
    """[batch or 1, length] positions of the new tokens: those given; else counted from a 2-D attention mask, so
    that a left-padded row's positions count its own tokens, as in training (rotary, being relative, would not
    show the difference; learned positions would); else past, past + 1, ...."""
    if position_ids is not None:
        return position_ids
    if attention_mask is not None and attention_mask.dim() == 4:
        raise ValueError("a 4-D attention_mask [batch, 1, queries, keys] says which keys each query sees, not where "
                         "each token is: pass position_ids with it (a 2-D mask's cumsum(-1) - 1), or pass the 2-D "
                         "attention_mask [batch, keys] instead")
    if attention_mask is not None:
        return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -length:]
    return torch.arange(past, past + length, device=device)[None]


def attention_mask_for(attention_mask: Tensor | None, query_len: int, key_len: int,
                       device: torch.device) -> Tensor | None:
    """Boolean [batch or 1, 1, query_len, key_len], True where a query may attend; None for plain causal
    attention over a whole sequence (no cache, no padding). Padded queries attend to themselves only, so that no
    row is empty (an empty row is NaN, which would reach the real tokens through 0 · NaN). Made once per forward
    for every layer: whether the mask pads is read by the host, on a GPU a synchronisation."""
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}: pass [batch, keys] (1 for a token, "
                         "0 for padding) or a 4-D [batch, 1, queries, keys] mask with position_ids")
    padded = attention_mask is not None and not bool(attention_mask.all())
    if query_len == key_len and not padded:
        return None
    mask = torch.ones(query_len, key_len, dtype=torch.bool, device=device).tril(diagonal=key_len - query_len)
    if not padded:
        return mask
    keys = attention_mask[:, None, None, -key_len:].bool()
    itself = torch.zeros_like(mask)
    itself[:, key_len - query_len:] = torch.eye(query_len, dtype=torch.bool, device=device)
    return mask & keys | itself


class TokenFormerAttention(nn.Module):
    def __init__(self, config: TokenFormerConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        add_pattentions(self, "attention", config, layer_idx)
        self.num_heads, self.rotary_dims, self.rotary_base = config.num_attention_heads, config.rotary_dims, \
            config.rotary_emb_base
        self.attention_dropout = config.attention_dropout

    def forward(self, x: Tensor, position_ids: Tensor, attention_mask: Tensor | None,
                past_key_values: Cache | None) -> Tensor:
        """`attention_mask`: attention_mask_for's (None: causal over the whole sequence)."""
        batch, length, _ = x.shape
        query, key, value = (getattr(self, name)(x).view(batch, length, self.num_heads, -1).transpose(1, 2)
                             for name in ("query", "key", "value"))
        if self.rotary_dims:
            cos, sin = rotary_cos_sin(position_ids, self.rotary_dims, self.rotary_base)
            query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        context = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                 is_causal=attention_mask is None,
                                                 dropout_p=self.attention_dropout if self.training else 0.0)
        return self.proj(context.transpose(1, 2).flatten(2))


class TokenFormerLayer(GradientCheckpointingLayer):
    def __init__(self, config: TokenFormerConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = layer_norm(config.norm, config)
        self.attention = TokenFormerAttention(config, layer_idx)
        self.post_attention_layernorm = layer_norm(config.norm, config)
        add_pattentions(self, "", config, layer_idx)
        self.hidden_dropout = config.hidden_dropout

    def forward(self, x: Tensor, position_ids: Tensor, attention_mask: Tensor | None = None,
                past_key_values: Cache | None = None) -> Tensor:
        attended = self.attention(self.input_layernorm(x), position_ids, attention_mask, past_key_values)
        x = x + F.dropout(attended, self.hidden_dropout, self.training)
        return x + F.dropout(self.mlp(self.post_attention_layernorm(x)), self.hidden_dropout, self.training)


class TokenFormerPreTrainedModel(PreTrainedModel):
    config_class = TokenFormerConfig
    config: TokenFormerConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["TokenFormerLayer"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """A fresh model (from a config, not a checkpoint) starts as the framework's default init: keys and
        embeddings normal(initializer_range), value tokens normal(initializer_range / √(2·layers))."""
        std = self.config.initializer_range
        if isinstance(module, TokenFormerPattention):
            module.key_param_tokens.normal_(0.0, std)
            module.value_param_tokens.normal_(0.0, std / math.sqrt(2 * self.config.num_hidden_layers))
        else:
            super()._init_weights(module)


class TokenFormerModel(TokenFormerPreTrainedModel):
    """Embeddings, layers and the final norm: token ids [batch, seq] -> hidden states [batch, seq, hidden]."""

    def __init__(self, config: TokenFormerConfig) -> None:
        super().__init__(config)
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = (nn.Embedding(config.max_position_embeddings, config.hidden_size)
                                    if config.pos_emb == "learned" else None)
        self.layers = nn.ModuleList(TokenFormerLayer(config, i) for i in range(config.num_hidden_layers))
        self.final_norm = layer_norm(config.final_norm, config)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.word_embeddings = value

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, past_key_values: Cache | None = None,
                inputs_embeds: Tensor | None = None, use_cache: bool | None = None,
                **kwargs) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        hidden = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        use_cache = self.config.use_cache if use_cache is None else use_cache
        use_cache = use_cache and not (self.gradient_checkpointing and self.training)  # a cache would be recomputed
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        cache = past_key_values if use_cache else None
        past, length = (past_key_values.get_seq_length() if past_key_values is not None else 0), hidden.shape[1]
        position_ids = position_ids_for(position_ids, attention_mask, past, length, hidden.device)
        position_ids = position_ids.expand(hidden.shape[0], -1)
        mask = attention_mask_for(attention_mask, length, length + (past if cache is not None else 0), hidden.device)
        if self.position_embeddings is not None:
            hidden = hidden + self.position_embeddings(position_ids)
        hidden = F.dropout(hidden, self.config.hidden_dropout, self.training)
        for layer in self.layers:  # the cache by keyword: gradient checkpointing leaves it out of the recomputation
            hidden = layer(hidden, position_ids, mask, past_key_values=cache)
        return BaseModelOutputWithPast(last_hidden_state=self.final_norm(hidden), past_key_values=cache)


class TokenFormerForCausalLM(TokenFormerPreTrainedModel, GenerationMixin):
    """TokenFormerModel with the output layer: logits over the padded vocabulary (config.vocab_size)."""

    _tied_weights_keys = {"lm_head.weight": "model.word_embeddings.weight"}

    def __init__(self, config: TokenFormerConfig) -> None:
        super().__init__(config)
        self.model = TokenFormerModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, past_key_values: Cache | None = None,
                inputs_embeds: Tensor | None = None, labels: Tensor | None = None, use_cache: bool | None = None,
                logits_to_keep: int | Tensor = 0, **kwargs) -> CausalLMOutputWithPast:
        outputs = self.model(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache)
        hidden = outputs.last_hidden_state
        if isinstance(logits_to_keep, int):
            hidden = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        else:
            hidden = hidden[:, logits_to_keep]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values)


__all__ = ["TokenFormerConfig", "TokenFormerForCausalLM", "TokenFormerModel", "TokenFormerPreTrainedModel"]
