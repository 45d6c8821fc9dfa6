"""Build a tokenizer from the config's ``tokenizer_type``/``vocab_file``/``merge_file`` and pad its vocabulary."""

import os

from megatron.tokenizer.abstract_tokenizer import AbstractTokenizer
from megatron.tokenizer.char_level_tokenizer import CharLevelTokenizer
from megatron.tokenizer.hf_tokenizer import HFTokenizer

SUPPORTED_TOKENIZER_TYPES = ("HFTokenizer", "CharLevelTokenizer")


def build_tokenizer(
    tokenizer_type: str, vocab_file: str | None = None, merge_file: str | None = None
) -> AbstractTokenizer:
    """The tokenizer named ``tokenizer_type``; ``merge_file`` is for the BPE types still to come."""
    if tokenizer_type == "CharLevelTokenizer":
        return CharLevelTokenizer()
    if tokenizer_type == "HFTokenizer":
        if not vocab_file:
            raise ValueError("tokenizer_type HFTokenizer needs vocab_file: the path of a tokenizer.json")
        if not os.path.isfile(vocab_file):
            raise FileNotFoundError(f"vocab_file {vocab_file} not found (tokenizer_type HFTokenizer)")
        return HFTokenizer(vocab_file)
    raise ValueError(
        f"unknown tokenizer_type {tokenizer_type!r}; supported: {', '.join(SUPPORTED_TOKENIZER_TYPES)} "
        f"(GPT2BPETokenizer and SPMTokenizer come with the data-pipeline issue)"
    )


def pad_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, model_parallel_size: int) -> int:
    """Round up to a multiple of ``make_vocab_size_divisible_by * model_parallel_size`` (GPT-NeoX).

    The embedding is split across model-parallel ranks and fast matmuls want
    aligned shapes; the extra ids are never produced by the tokenizer.
    """
    if vocab_size <= 0 or make_vocab_size_divisible_by <= 0 or model_parallel_size <= 0:
        raise ValueError(
            f"vocab_size, make_vocab_size_divisible_by and model_parallel_size must be positive, "
            f"got {vocab_size}, {make_vocab_size_divisible_by}, {model_parallel_size}"
        )
    multiple = make_vocab_size_divisible_by * model_parallel_size
    return -(-vocab_size // multiple) * multiple
