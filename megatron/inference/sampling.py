"""Choosing the next token from logits, with GPT-NeoX's semantics for its config keys.

Greedy (argmax) when temperature, top_k and top_p are all 0; otherwise a draw from
softmax(logits / temperature) (temperature 0 counts as 1) restricted to the top_k most likely tokens
and/or the smallest set whose probability reaches top_p (nucleus sampling).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0

    def __post_init__(self) -> None:
        if self.temperature < 0 or self.top_k < 0 or not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"sampling needs temperature >= 0, top_k >= 0 and top_p in [0, 1], got {self}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 and self.top_k == 0 and self.top_p == 0


def filter_logits(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """logits [b, V] with every token outside the top_k / the top_p nucleus set to -inf (0 disables each)."""
    if top_k:
        kth_best = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_best, float("-inf"))
    if top_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probabilities = sorted_logits.softmax(dim=-1)
        sorted_outside = probabilities.cumsum(dim=-1) - probabilities >= top_p  # the best token always stays
        outside = torch.empty_like(sorted_outside).scatter_(-1, order, sorted_outside)
        logits = logits.masked_fill(outside, float("-inf"))
    return logits


def next_tokens(logits: Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> Tensor:
    """One token id per row of logits [b, V]."""
    if params.greedy:
        return logits.argmax(dim=-1)
    logits = logits.float()
    if params.temperature > 0:
        logits = logits / params.temperature
    probabilities = filter_logits(logits, params.top_k, params.top_p).softmax(dim=-1)
    return torch.multinomial(probabilities, 1, generator=generator).squeeze(-1)
