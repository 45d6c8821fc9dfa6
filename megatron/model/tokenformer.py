"""The TokenFormer language model (Wang et al., ICLR 2025): tokens [b, s] -> logits [b, s, vocab / tp].

With tensor parallelism (tp = model_parallel_size ranks) the embedding, the output layer and the logits
are split by vocabulary (this rank's block [b, s, vocab / tp]; `mpu.vocab_parallel_cross_entropy` takes
them as they are, `mpu.gather_from_region(logits, -1)` assembles them); everything else is split inside
the layers (docs/tensor_parallel.md). With tp = 1 the logits are the whole vocabulary.

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
Non-parametric layer norms (`input_layernorm`, `post_attention_layernorm`) have no entries. This
framework's pipeline (pipeline.py) numbers its layers, and their checkpoint files, the same way.
"""

import torch
from torch import Tensor, nn

from megatron.model.args import TokenFormerArgs
from megatron.model.embedding import embed, input_embeddings
from megatron.model.init_methods import initialize_parameters
from megatron.model.init_roles import InitRole
from megatron.model.kv_cache import KVCache
from megatron.model.layer import TokenFormerLayer
from megatron.model.norms import make_layer_norm
from megatron.mpu import VocabParallelOutput, checkpoint, vocab_parallel_logits


class TokenFormerModel(nn.Module):
    """Built on `device` and initialised from `args.seed`; on the meta device it is left uninitialised
    (for counting parameters without allocating them)."""

    def __init__(self, args: TokenFormerArgs, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.args = args
        d, vocab = args.hidden_size, args.padded_vocab_size
        self.word_embeddings, self.position_embeddings = input_embeddings(args, device)
        self.layers = nn.ModuleList(TokenFormerLayer(args, device) for _ in range(args.num_layers))
        self.final_norm = make_layer_norm(args.final_norm, d, args.layernorm_epsilon, device)
        self.final_linear = VocabParallelOutput(d, vocab, device=device) if args.no_weight_tying else None
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
        """The [vocab / tp, d] block the logits are computed with (the embedding's when tied)."""
        return self.word_embeddings.weight if self.final_linear is None else self.final_linear.weight

    def _forward_layers(self, hidden: Tensor, start: int, end: int) -> Tensor:
        for layer in self.layers[start:end]:
            hidden = layer(hidden)
        return hidden

    def forward(self, tokens: Tensor, cache: KVCache | None = None) -> Tensor:
        """With a `cache` (generation), `tokens` follow the cached ones, whose keys and values are reused."""
        hidden = embed(tokens, self.word_embeddings, self.position_embeddings, self.args, self.training,
                       first_position=0 if cache is None else cache.length)

        if cache is not None:
            for layer, layer_cache in zip(self.layers, cache.layers, strict=True):
                hidden = layer(hidden, layer_cache)
        elif self.args.checkpoint_activations and self.training and torch.is_grad_enabled():
            group = self.args.checkpoint_num_layers
            for start in range(0, len(self.layers), group):
                hidden = checkpoint(self._forward_layers, hidden, start, start + group)
        else:
            hidden = self._forward_layers(hidden, 0, len(self.layers))

        return vocab_parallel_logits(self.final_norm(hidden), self.output_weight)
