"""Autoregressive generation from prompt tokens, with or without the KV cache, under any tensor-parallel layout.

With the cache (the default) the prompt goes through the model once and every later step feeds only the
newest token; without it (`recompute`) every step runs the whole sequence again. Both choose the same
tokens. Under tensor parallelism each step's logits are gathered over the vocabulary blocks, and the
token chosen on tensor rank 0 is the one every rank continues with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from megatron.inference.sampling import SamplingParams, next_tokens
from megatron.model import TokenFormerModel
from megatron.model.kv_cache import KVCache
from megatron.mpu import gather_from_region
from megatron.runtime.collectives import same_on_tensor_ranks


@dataclass
class Generation:
    """The new tokens of one sequence (without the prompt and the end-of-document token), and whether it
    ended by itself (end-of-document or `stop`) rather than at maximum_tokens or the position limit."""

    tokens: list[int] = field(default_factory=list)
    finished: bool = False


def last_token_logits(model: TokenFormerModel, tokens: Tensor, cache: KVCache | None = None) -> Tensor:
    """Logits [b, whole vocabulary] at the last position of tokens [b, s]."""
    return gather_from_region(model(tokens, cache)[:, -1], -1).float()


@torch.no_grad()
def generate(
    model: TokenFormerModel,
    prompts: Tensor,
    maximum_tokens: int,
    sampling: SamplingParams,
    eod: int | None = None,
    vocab_size: int | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    stop: Callable[[list[int]], bool] | None = None,
) -> list[Generation]:
    """Up to `maximum_tokens` new tokens after each row of prompts [b, s] (rows share a length).

    `vocab_size` keeps the choice to real token ids (the padded rows of the vocabulary are never chosen);
    `stop(tokens so far)` ends a row early, e.g. when a stop string appears in its text. The sequence never
    grows past max_position_embeddings.
    """
    limit = model.args.max_position_embeddings
    if prompts.shape[1] >= limit:
        raise ValueError(f"a prompt of {prompts.shape[1]} tokens leaves no room to generate: "
                         f"max_position_embeddings={limit}; shorten the prompt")
    cache = KVCache(len(model.layers)) if use_cache else None
    sequence, step_input = prompts, prompts
    results = [Generation() for _ in range(prompts.shape[0])]
    for _ in range(min(maximum_tokens, limit - prompts.shape[1])):
        logits = last_token_logits(model, step_input if use_cache else sequence, cache)
        if vocab_size is not None:
            logits[:, vocab_size:] = float("-inf")
        chosen = same_on_tensor_ranks(next_tokens(logits, sampling, generator))
        sequence = torch.cat((sequence, chosen[:, None]), dim=1)
        step_input = chosen[:, None]
        for result, token in zip(results, chosen.tolist()):
            if result.finished:
                continue
            if token == eod:
                result.finished = True
            else:
                result.tokens.append(token)
                result.finished = stop is not None and stop(result.tokens)
        if all(result.finished for result in results):
            break
    return results
