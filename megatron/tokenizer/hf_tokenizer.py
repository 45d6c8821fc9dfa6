"""A HuggingFace ``tokenizer.json`` (e.g. GPT-NeoX-20B's) through the ``tokenizers`` library."""

from collections.abc import Sequence

from tokenizers import Tokenizer, pre_tokenizers

from megatron.cli import InputError
from megatron.tokenizer.abstract_tokenizer import AbstractTokenizer

EOD_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|padding|>"


def byte_level_cut(tokenizer: Tokenizer) -> str | None:
    """"keep" for a byte-level BPE (GPT-2, GPT-NeoX): its pre-tokenizer starts a token at every space before a
    word; None if it is another kind, or adds special tokens to every text."""
    plain = tokenizer.encode("a b", add_special_tokens=False).ids
    if isinstance(tokenizer.pre_tokenizer, pre_tokenizers.ByteLevel) and tokenizer.encode("a b").ids == plain:
        return "keep"
    return None


class HFTokenizer(AbstractTokenizer):
    """GPT-NeoX conventions: eod is ``<|endoftext|>``; pad is ``<|padding|>``, or eod when the vocab has none."""

    def __init__(self, vocab_file: str):
        try:
            self._tokenizer = Tokenizer.from_file(vocab_file)
        except Exception as error:  # the Rust side raises plain Exception for unreadable JSON
            raise InputError(f"vocab_file {vocab_file} is not a valid tokenizer.json: {error}") from error
        eod = self._tokenizer.token_to_id(EOD_TOKEN)
        if eod is None:
            raise InputError(f"vocab_file {vocab_file} has no {EOD_TOKEN} token (HFTokenizer ends documents with it)")
        pad = self._tokenizer.token_to_id(PAD_TOKEN)
        self._eod = eod
        self._pad = eod if pad is None else pad

    @property
    def backend(self) -> Tokenizer:
        """The `tokenizers.Tokenizer` doing the work (what a tokenizer.json holds)."""
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._pad

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    @property
    def piece_cut(self) -> str | None:
        return byte_level_cut(self._tokenizer)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self._tokenizer.encode_batch(list(texts))]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(self.checked_ids(ids), skip_special_tokens=True)
