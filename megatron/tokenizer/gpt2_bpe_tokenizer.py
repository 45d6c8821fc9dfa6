"""GPT-2's byte-level BPE from its original ``vocab.json`` + ``merges.txt`` (GPT-NeoX's GPT2BPETokenizer)."""

from collections.abc import Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from megatron.cli import InputError
from megatron.tokenizer.abstract_tokenizer import AbstractTokenizer
from megatron.tokenizer.hf_tokenizer import byte_level_cut

EOD_TOKEN = "<|endoftext|>"


class GPT2BPETokenizer(AbstractTokenizer):
    """GPT-2's regex pre-tokenizer and byte-level BPE; ``<|endoftext|>`` in the text stays plain text.

    eod is the ``<|endoftext|>`` entry of vocab.json; GPT-2 has no padding
    token, so pad is eod.
    """

    def __init__(self, vocab_file: str, merge_file: str):
        try:
            model = models.BPE.from_file(vocab_file, merge_file)
        except Exception as error:  # the Rust side raises plain Exception for unreadable files
            raise InputError(
                f"vocab_file {vocab_file} / merge_file {merge_file} are not a GPT-2 vocab.json + merges.txt: {error}"
            ) from error
        self._tokenizer = Tokenizer(model)
        self._tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tokenizer.decoder = decoders.ByteLevel()
        eod = self._tokenizer.token_to_id(EOD_TOKEN)
        if eod is None:
            raise InputError(
                f"vocab_file {vocab_file} has no {EOD_TOKEN} entry (GPT2BPETokenizer ends documents with it)"
            )
        self._eod = eod

    @property
    def backend(self) -> Tokenizer:
        """The `tokenizers.Tokenizer` doing the work (what a tokenizer.json holds)."""
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size()

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    @property
    def piece_cut(self) -> str | None:
        return byte_level_cut(self._tokenizer)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self._tokenizer.encode_batch(list(texts))]

    def detokenize(self, ids: Sequence[int]) -> str:
        values = self.checked_ids(ids)
        return self._tokenizer.decode([i for i in values if i != self._eod])
