"""The TokenFormer language model (Wang et al., ICLR 2025): tokens [b, s] -> logits [b, s, vocab].

    word_embeddings (+ position_embeddings if pos_emb == "learned") -> dropout
    -> num_layers × TokenFormerLayer -> final_norm -> logits = h · Eᵀ (tied) or h · final_linearᵀ

state_dict names and the official GPT-NeoX pipeline checkpoint (layer file index: key inside it):
    word_embeddings.weight                 0: word_embeddings.weight
    position_embeddings.weight             0: position_embeddings.weight
    layers.{i}.<rest>                      i+2: <rest>   e.g. attention.query.key_param_tokens,
                                           attention.proj.value_param_tokens, mlp.key_param_tokens
    final_norm.weight / .bias              num_layers+3: norm.weight / .bias
    final_linear.weight (untied only)      num_layers+4: final_linear.weight
    layers.{i}.**.norm_token_count         absent: set it to that Pattention's token count
Non-parametric layer norms (`input_layernorm`, `post_attention_layernorm`) have no entries.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from megatron.model.args import TokenFormerArgs
from megatron.model.init_methods import InitRole, initialize_parameters
from megatron.model.layer import TokenFormerLayer
from megatron.model.norms import make_layer_norm


class TokenFormerModel(nn.Module):
    """Built on `device` and initialised from `args.seed`; on the meta device it is left uninitialised
    (for counting parameters without allocating them)."""

    def __init__(self, args: TokenFormerArgs, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.args = args
        d, vocab = args.hidden_size, args.padded_vocab_size
        self.word_embeddings = nn.Embedding(vocab, d, device=device)
        self.position_embeddings = (
            nn.Embedding(args.max_position_embeddings, d, device=device) if args.pos_emb == "learned" else None)
        self.layers = nn.ModuleList(TokenFormerLayer(args, device) for _ in range(args.num_layers))
        self.final_norm = make_layer_norm(args.final_norm, d, args.layernorm_epsilon, device)
        self.final_linear = nn.Linear(d, vocab, bias=False, device=device) if args.no_weight_tying else None
        if torch.device(device).type != "meta":
            initialize_parameters(self, args.seed, args)

    def init_roles(self) -> dict[str, InitRole]:
        """Embeddings and the untied output weight use `init_method`, as in GPT-NeoX."""
        roles = {"word_embeddings.weight": InitRole.INPUT}
        if self.position_embeddings is not None:
            roles["position_embeddings.weight"] = InitRole.INPUT
        if self.final_linear is not None:
            roles["final_linear.weight"] = InitRole.INPUT
        return roles

    @property
    def output_weight(self) -> Tensor:
        """The [vocab, d] matrix the logits are computed with (the embedding when tied)."""
        return self.word_embeddings.weight if self.final_linear is None else self.final_linear.weight

    def _forward_layers(self, hidden: Tensor, start: int, end: int) -> Tensor:
        for layer in self.layers[start:end]:
            hidden = layer(hidden)
        return hidden

    def forward(self, tokens: Tensor) -> Tensor:
        seq_len = tokens.shape[1]
        hidden = self.word_embeddings(tokens)
        if self.position_embeddings is not None:
            if seq_len > self.args.max_position_embeddings:
                raise ValueError(f"sequence of {seq_len} tokens exceeds max_position_embeddings="
                                 f"{self.args.max_position_embeddings}: shorten it or raise the setting")
            hidden = hidden + self.position_embeddings(torch.arange(seq_len, device=tokens.device))
        hidden = F.dropout(hidden, self.args.hidden_dropout, self.training)

        if self.args.checkpoint_activations and self.training and torch.is_grad_enabled():
            group = self.args.checkpoint_num_layers
            for start in range(0, len(self.layers), group):
                hidden = checkpoint(self._forward_layers, hidden, start, start + group, use_reentrant=False)
        else:
            hidden = self._forward_layers(hidden, 0, len(self.layers))

        return F.linear(self.final_norm(hidden), self.output_weight)
