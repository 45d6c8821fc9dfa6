"""A SentencePiece ``.model`` (unigram or BPE), e.g. one made by tools/train_tokenizer.py."""

from collections.abc import Sequence

import sentencepiece

from megatron.cli import InputError
from megatron.tokenizer.abstract_tokenizer import AbstractTokenizer

EOD_TOKEN = "<|endoftext|>"


class SPMTokenizer(AbstractTokenizer):
    """eod is the ``<|endoftext|>`` piece if the model has one, else its eos; pad is its pad, else eod."""

    def __init__(self, vocab_file: str):
        self.model_file = vocab_file
        self._processor = sentencepiece.SentencePieceProcessor()
        try:
            self._processor.load(vocab_file)
        except (OSError, RuntimeError) as error:
            raise InputError(f"vocab_file {vocab_file} is not a SentencePiece model: {error}") from error
        eod = self._processor.piece_to_id(EOD_TOKEN)
        if eod == self._processor.unk_id() or self._processor.id_to_piece(eod) != EOD_TOKEN:
            eod = self._processor.eos_id()
        if eod < 0:
            raise InputError(
                f"vocab_file {vocab_file} has neither an {EOD_TOKEN} piece nor an eos id; "
                f"SPMTokenizer ends documents with one (train with tools/train_tokenizer.py)"
            )
        pad = self._processor.pad_id()
        self._eod = eod
        self._pad = eod if pad < 0 else pad

    @property
    def vocab_size(self) -> int:
        return self._processor.get_piece_size()

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._pad

    def tokenize(self, text: str) -> list[int]:
        return self._processor.encode(text)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._processor.encode(list(texts))

    @property
    def piece_cut(self) -> str | None:
        """"drop" where words are split at whitespace and a dummy prefix starts every text (SentencePiece's
        defaults): the space left out of a cut comes back as the next piece's prefix."""
        from sentencepiece import sentencepiece_model_pb2

        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(self._processor.serialized_model_proto())
        return "drop" if proto.trainer_spec.split_by_whitespace and proto.normalizer_spec.add_dummy_prefix else None

    def detokenize(self, ids: Sequence[int]) -> str:
        values = self.checked_ids(ids)
        return self._processor.decode([i for i in values if i not in (self._eod, self._pad)])
