"""Keys and values of the tokens already processed, so that generation feeds each new token through the
model once instead of recomputing the whole sequence at every step.

Each attention layer appends its new keys/values (after rotary, this rank's heads) and attends with the
new queries to all of them; positions continue from `length`. The cache grows by concatenation, which is
simple and plenty for the lengths generated here.
"""

from __future__ import annotations

import torch
from torch import Tensor


class LayerKVCache:
    """One attention layer's keys and values so far, [batch, local heads, tokens, head_dim] each."""

    def __init__(self) -> None:
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def extend(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Append the new tokens' keys and values; returns those of every token so far."""
        if self.keys is not None:
            keys, values = torch.cat((self.keys, keys), dim=2), torch.cat((self.values, values), dim=2)
        self.keys, self.values = keys, values
        return keys, values


class KVCache:
    """A LayerKVCache per layer of a model; `length` tokens processed so far."""

    def __init__(self, num_layers: int) -> None:
        self.layers = [LayerKVCache() for _ in range(num_layers)]

    @property
    def length(self) -> int:
        return self.layers[0].length


def causal_mask(query_len: int, key_len: int, device: torch.device) -> Tensor:
    """[query_len, key_len], True where a query (the last query_len of key_len positions) may attend."""
    return torch.ones(query_len, key_len, dtype=torch.bool, device=device).tril(diagonal=key_len - query_len)
