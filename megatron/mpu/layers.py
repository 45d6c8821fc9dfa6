"""Tensor-parallel layers. Vocabulary-parallel input and output layers: rank r holds rows [r·V/t, (r+1)·V/t) of the
[V, d] matrix. Megatron's column- and row-parallel linear layers, for the dense Transformer baseline.

The vocabulary is padded to a multiple of make_vocab_size_divisible_by × model_parallel_size, so the
blocks are equal. The output layer leaves the logits split by vocabulary ([..., V/t] on each rank):
`vocab_parallel_cross_entropy` consumes them without ever gathering V logits per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megatron.mpu.mappings import copy_to_region, reduce_from_region
from megatron.mpu.sharding import block_start, mark_split, split_size


class VocabParallelEmbedding(nn.Module):
    """Token ids [...] -> embeddings [..., d], replicated on every tensor-parallel rank.

    Each rank looks up the ids in its block and contributes zeros for the others; one all-reduce of
    [tokens, d] sums the contributions.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, device: str | torch.device | None = None) -> None:
        super().__init__()
        local_rows = split_size(num_embeddings, "the padded vocabulary size")
        self.vocab_start = block_start(local_rows)
        self.weight = nn.Parameter(torch.empty(local_rows, embedding_dim, device=device))
        mark_split(self.weight, dim=0)

    def forward(self, tokens: Tensor) -> Tensor:
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        embedded = F.embedding(local.masked_fill(outside, 0), self.weight)
        return reduce_from_region(embedded.masked_fill(outside.unsqueeze(-1), 0.0))

    def extra_repr(self) -> str:
        rows, dim = self.weight.shape
        return f"rows {self.vocab_start}..{self.vocab_start + rows - 1}, {dim}"


def vocab_parallel_logits(hidden: Tensor, weight: Tensor) -> Tensor:
    """This rank's vocabulary block of the logits: replicated hidden [..., d] · weightᵀ, weight [V/t, d]
    (the embedding's block when input and output weights are tied)."""
    return F.linear(copy_to_region(hidden), weight)


class VocabParallelOutput(nn.Module):
    """The untied output layer: its own [V/t, d] block, hidden [..., d] -> logits block [..., V/t]."""

    def __init__(self, hidden_size: int, vocab_size: int, device: str | torch.device | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(split_size(vocab_size, "the padded vocabulary size"), hidden_size, device=device))
        mark_split(self.weight, dim=0)

    def forward(self, hidden: Tensor) -> Tensor:
        return vocab_parallel_logits(hidden, self.weight)


class ColumnParallelLinear(nn.Module):
    """y = x·Wᵀ + b split by output features: rank r holds rows [r·d_out/t, (r+1)·d_out/t) of W [d_out, d_in] and
    of b, takes the replicated x and returns its block of y. Backward all-reduces x's gradient (copy_to_region)."""

    def __init__(self, input_size: int, output_size: int, device: str | torch.device | None = None) -> None:
        super().__init__()
        local = split_size(output_size, f"output features of a {input_size} -> {output_size} layer")
        self.weight = nn.Parameter(torch.empty(local, input_size, device=device))
        self.bias = nn.Parameter(torch.empty(local, device=device))
        mark_split(self.weight, dim=0)
        mark_split(self.bias, dim=0)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(copy_to_region(x), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x·Wᵀ + b split by input features: rank r holds columns [r·d_in/t, (r+1)·d_in/t) of W [d_out, d_in],
    takes its block of x (a column-parallel layer's output) and all-reduces the partial products into the
    replicated y; b is replicated, added once after the sum. Megatron's output layers of attention and MLP."""

    def __init__(self, input_size: int, output_size: int, device: str | torch.device | None = None) -> None:
        super().__init__()
        local = split_size(input_size, f"input features of a {input_size} -> {output_size} layer")
        self.weight = nn.Parameter(torch.empty(output_size, local, device=device))
        self.bias = nn.Parameter(torch.empty(output_size, device=device))
        mark_split(self.weight, dim=1)

    def forward(self, x: Tensor) -> Tensor:
        return reduce_from_region(F.linear(x, self.weight)) + self.bias
