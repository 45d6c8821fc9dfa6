"""Byte-level tokenizer needing no files: ids 0-255 are the UTF-8 bytes, 256 ends a document."""

from collections.abc import Sequence

from megatron.tokenizer.abstract_tokenizer import AbstractTokenizer

_BYTE_VALUES = 256


class CharLevelTokenizer(AbstractTokenizer):
    """Every text round-trips exactly; useful for tests and tokenizer-free experiments."""

    @property
    def vocab_size(self) -> int:
        return _BYTE_VALUES + 1

    @property
    def eod(self) -> int:
        return _BYTE_VALUES

    @property
    def pad(self) -> int:
        return self.eod

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    @property
    def piece_cut(self) -> str | None:
        return "keep"  # a byte is a token

    def detokenize(self, ids: Sequence[int]) -> str:
        return bytes(i for i in self.checked_ids(ids) if i != self.eod).decode("utf-8", errors="replace")
