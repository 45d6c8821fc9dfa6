"""Build a tokenizer from the config's ``tokenizer_type``/``vocab_file``/``merge_file`` and pad its vocabulary."""

import os

from megatron.cli import InputError
from megatron.tokenizer.abstract_tokenizer import AbstractTokenizer
from megatron.tokenizer.char_level_tokenizer import CharLevelTokenizer
from megatron.tokenizer.gpt2_bpe_tokenizer import GPT2BPETokenizer
from megatron.tokenizer.hf_tokenizer import HFTokenizer
from megatron.tokenizer.spm_tokenizer import SPMTokenizer

SUPPORTED_TOKENIZER_TYPES = ("HFTokenizer", "GPT2BPETokenizer", "SPMTokenizer", "CharLevelTokenizer")
# The files each type reads, as (config key, what the file is).
_NEEDED_FILES = {
    "HFTokenizer": (("vocab_file", "a tokenizer.json"),),
    "GPT2BPETokenizer": (("vocab_file", "GPT-2's vocab.json"), ("merge_file", "GPT-2's merges.txt")),
    "SPMTokenizer": (("vocab_file", "a SentencePiece .model"),),
    "CharLevelTokenizer": (),
}


def build_tokenizer(
    tokenizer_type: str, vocab_file: str | None = None, merge_file: str | None = None
) -> AbstractTokenizer:
    """The tokenizer named ``tokenizer_type``, reading ``vocab_file`` (and ``merge_file`` for GPT2BPETokenizer)."""
    if tokenizer_type not in _NEEDED_FILES:
        supported = ", ".join(SUPPORTED_TOKENIZER_TYPES)
        raise InputError(f"unknown tokenizer_type {tokenizer_type!r}; supported: {supported}")
    given = {"vocab_file": vocab_file, "merge_file": merge_file}
    for key, description in _NEEDED_FILES[tokenizer_type]:
        if not given[key]:
            raise InputError(f"tokenizer_type {tokenizer_type} needs {key}: the path of {description}")
        if not os.path.isfile(given[key]):
            raise FileNotFoundError(f"{key} {given[key]} not found (tokenizer_type {tokenizer_type})")
    if tokenizer_type == "HFTokenizer":
        return HFTokenizer(vocab_file)
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "SPMTokenizer":
        return SPMTokenizer(vocab_file)
    return CharLevelTokenizer()


def pad_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, model_parallel_size: int) -> int:
    """Round up to a multiple of ``make_vocab_size_divisible_by * model_parallel_size`` (GPT-NeoX).

    The embedding is split across model-parallel ranks and fast matmuls want
    aligned shapes; the extra ids are never produced by the tokenizer.
    """
    if vocab_size <= 0 or make_vocab_size_divisible_by <= 0 or model_parallel_size <= 0:
        raise InputError(
            f"vocab_size, make_vocab_size_divisible_by and model_parallel_size must be positive, "
            f"got {vocab_size}, {make_vocab_size_divisible_by}, {model_parallel_size}"
        )
    multiple = make_vocab_size_divisible_by * model_parallel_size
    return -(-vocab_size // multiple) * multiple
