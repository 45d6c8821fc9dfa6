"""The official TokenFormer release's weight layout (`pytorch_model.bin` of TokenFormer-150M/450M/900M/1-5B)
to and from TokenFormerModel's state dict.

The release is the state dict of the official code's GPT-NeoX pipeline model after `to_sequential()`: a
`SequentialWrapper` whose `sequential` holds pipeline layer i as `sequential.{i}` (official
megatron/model/gpt2_model.py, utils.py; the official eval loads it with `model.module.load_state_dict`).
The layers are numbered as in megatron/model/pipeline.py, L = num_layers:

    official key                                            TokenFormerModel name
    sequential.0.word_embeddings.weight                     word_embeddings.weight
    sequential.0.position_embeddings.weight (learned)       position_embeddings.weight
    sequential.{i+2}.<official_path>.{key,value}_param_tokens    layers.{i}.<path>.<same>
        (each Pattention's paths: megatron/model/spec.py; attention.{query,key,value,proj} and mlp in both)
    sequential.{L+3}.norm.weight / .bias (final layernorm)  final_norm.weight / .bias
    sequential.{L+4}.final_linear.weight (untied only)      final_linear.weight
    -                                                       layers.{i}.**.norm_token_count

Layers 1 and L+2 (transposes), the tied output (it reuses sequential.0's embedding) and the blocks'
parameter-free layer norms have no entries. The official Pattention normalises by its own token count
(`inputs.shape[-1]`) with τ = 1: import sets each `norm_token_count` to its layer's token count, and export
refuses a model whose counts differ (a grown model is not expressible in the official layout).
`sequential.{i}.attention.rotary_emb.inv_freq` exists only in files saved with rotary_save_freqs_buffer;
import checks it against rotary_emb_base and drops it (the frequencies are recomputed).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import Tensor

from megatron.cli import InputError
from megatron.config import Config
from megatron.formats import consolidated
from megatron.formats.consolidated import weight_names, weights_file
from megatron.model import TokenFormerArgs
from megatron.model.pipeline import model_parameter_name
from megatron.model.spec import layer_pattentions, pattention_at

PREFIX = "sequential."
_TOKEN_COUNT = "norm_token_count"
_INVERSE_FREQUENCIES = "attention.rotary_emb.inv_freq"


def _release_key_in_layer(key: str) -> str:
    """A layer's entry `key` (e.g. attention.query.key_param_tokens) under the release's module path."""
    path, _, leaf = key.rpartition(".")
    spec = pattention_at(path)
    return key if spec is None else f"{spec.official_path}.{leaf}"


def _model_key_in_layer(key: str) -> str:
    """_release_key_in_layer inverted."""
    path, _, leaf = key.rpartition(".")
    spec = next((spec for spec in layer_pattentions() if spec.official_path == path), None)
    return key if spec is None else f"{spec.path}.{leaf}"


def official_key(name: str, num_layers: int) -> str:
    """The official key of TokenFormerModel's state-dict entry `name` (not a norm_token_count)."""
    if name.startswith("layers."):
        index, _, rest = name.removeprefix("layers.").partition(".")
        return f"{PREFIX}{int(index) + 2}.{_release_key_in_layer(rest)}"
    if name.startswith("final_norm."):
        return f"{PREFIX}{num_layers + 3}.norm.{name.removeprefix('final_norm.')}"
    if name.startswith("final_linear."):
        return f"{PREFIX}{num_layers + 4}.{name}"
    return f"{PREFIX}0.{name}"


NAME = "official"


def is_official(names: Iterable[str]) -> bool:
    names = list(names)
    return bool(names) and all(name.startswith(PREFIX) for name in names)


def recognises(path: Path) -> bool:
    """Weights (a file, or a directory holding one) whose every name is an official key."""
    weights = weights_file(path)
    return weights is not None and is_official(weight_names(weights))


def read(path: Path, config: Config | str | Path | None) -> tuple[dict[str, Tensor], Config]:
    """The canonical state of the release's weights, and the config: `config`, or a config.json beside them."""
    state, cfg = consolidated.read(path, config)
    vocab = state[official_key("word_embeddings.weight", cfg.num_layers)].shape[0]
    return from_official(state, TokenFormerArgs.for_inference(cfg, vocab)), cfg


def _check_inverse_frequencies(key: str, frequencies: Tensor, args: TokenFormerArgs) -> None:
    dims = args.rotary_dims
    expected = 1.0 / (args.rotary_emb_base ** (torch.arange(0, dims, 2, dtype=torch.float32) / dims))
    if frequencies.shape != expected.shape or not torch.allclose(frequencies.float(), expected):
        raise InputError(f"{key} does not match rotary_pct={args.rotary_pct}, rotary_emb_base={args.rotary_emb_base}"
                         " of the config: set them to the values the release was trained with")


def from_official(official: Mapping[str, Tensor], args: TokenFormerArgs) -> dict[str, Tensor]:
    """TokenFormerModel's state dict of an official one (norm_token_count filled in)."""
    state = {}
    for key, tensor in official.items():
        index, _, rest = key.removeprefix(PREFIX).partition(".")
        if not key.startswith(PREFIX) or not index.isdigit():
            raise KeyError(f"{key!r} is not an official TokenFormer key (sequential.N.<name>): pass the release's "
                           "pytorch_model.bin")
        if rest == _INVERSE_FREQUENCIES:
            _check_inverse_frequencies(key, tensor, args)
            continue
        key = _model_key_in_layer(rest) if 2 <= int(index) < args.num_layers + 2 else rest
        state[model_parameter_name(int(index), key, args.num_layers)] = tensor
    for name in [name for name in state if name.endswith(".key_param_tokens")]:
        count_name = name.removesuffix("key_param_tokens") + _TOKEN_COUNT
        state[count_name] = torch.tensor(state[name].shape[0], dtype=torch.int64)
    return state


def to_official(state: Mapping[str, Tensor], num_layers: int, pattention_tau: float) -> dict[str, Tensor]:
    """The official layout of TokenFormerModel's state dict, of a model whose config has `pattention_tau`."""
    if pattention_tau != 1.0:
        raise InputError(f"pattention_tau = {pattention_tau}: the official code has no such factor (its scores are "
                         "X * K^T), so the model cannot be exported to its layout; only pattention_tau 1 can")
    official = {}
    for name, tensor in state.items():
        if name.endswith(_TOKEN_COUNT):
            tokens = state[name.removesuffix(_TOKEN_COUNT) + "key_param_tokens"].shape[0]
            if int(tensor) != tokens:
                raise InputError(f"{name} = {int(tensor)} but the layer has {tokens} parameter tokens; the official "
                                 "layout normalises by the token count, so this (grown) model cannot be exported")
            continue
        official[official_key(name, num_layers)] = tensor
    return official
