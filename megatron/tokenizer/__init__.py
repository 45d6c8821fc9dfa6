"""Tokenizers behind one small interface, built by name from the config."""

from megatron.tokenizer.abstract_tokenizer import AbstractTokenizer
from megatron.tokenizer.build import SUPPORTED_TOKENIZER_TYPES, build_tokenizer, pad_vocab_size

__all__ = ["AbstractTokenizer", "SUPPORTED_TOKENIZER_TYPES", "build_tokenizer", "pad_vocab_size"]
