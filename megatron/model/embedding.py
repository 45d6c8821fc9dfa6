"""The input embedding, shared by TokenFormerModel and the pipeline's first layer (pipeline.py).

    hidden = Dropout(word_embeddings[tokens] (+ position_embeddings[0..s-1] if pos_emb == "learned"))
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron.model.args import TokenFormerArgs
from megatron.mpu import VocabParallelEmbedding


def input_embeddings(args: TokenFormerArgs,
                     device: str | torch.device | None = None) -> tuple[VocabParallelEmbedding, nn.Embedding | None]:
    """(word_embeddings, position_embeddings or None), to be registered under those names."""
    words = VocabParallelEmbedding(args.padded_vocab_size, args.hidden_size, device=device)
    positions = (nn.Embedding(args.max_position_embeddings, args.hidden_size, device=device)
                 if args.pos_emb == "learned" else None)
    return words, positions


def embed(tokens: Tensor, word_embeddings: VocabParallelEmbedding, position_embeddings: nn.Embedding | None,
          args: TokenFormerArgs, training: bool, first_position: int = 0) -> Tensor:
    """Token ids [b, s] at positions first_position.. -> hidden [b, s, d], replicated on every tensor-parallel
    rank (first_position > 0 when generation feeds the tokens after those in its KV cache)."""
    hidden = word_embeddings(tokens)
    if position_embeddings is not None:
        end = first_position + tokens.shape[1]
        if end > args.max_position_embeddings:
            raise ValueError(f"sequence of {end} tokens exceeds max_position_embeddings="
                             f"{args.max_position_embeddings}: shorten it or raise the setting")
        hidden = hidden + position_embeddings(torch.arange(first_position, end, device=tokens.device))
    return F.dropout(hidden, args.hidden_dropout, training)
