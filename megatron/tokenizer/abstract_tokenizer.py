"""The interface the data pipeline and text generation rely on, whatever the tokenizer."""

from abc import ABC, abstractmethod
from collections.abc import Sequence

from megatron.cli import InputError


class AbstractTokenizer(ABC):
    """Text to token ids and back, plus the ids of the end-of-document and padding tokens."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids, before padding for model parallelism (see ``pad_vocab_size``)."""

    @property
    @abstractmethod
    def eod(self) -> int:
        """Id appended after each document so samples spanning documents show the border."""

    @property
    @abstractmethod
    def pad(self) -> int:
        """Id used to fill short sequences."""

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Ids of ``text``."""

    @property
    def piece_cut(self) -> str | None:
        """Where a long text may be cut into pieces whose ids, put together, are the whole text's (preprocessing
        tokenizes long documents in pieces, to bound its memory): at a single space between two words, the space
        starting the next piece ("keep") or left out because the tokenizer puts it back ("drop"); None: nowhere."""
        return None

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Ids of each text; tokenizers with a native batch encoder override this for speed."""
        return [self.tokenize(text) for text in texts]

    @abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; the end-of-document and padding ids are dropped."""

    def checked_ids(self, ids: Sequence[int]) -> list[int]:
        """``ids`` as ints; error naming the offenders when any lies outside the vocabulary."""
        values = [int(i) for i in ids]
        invalid = [i for i in values if not 0 <= i < self.vocab_size]
        if invalid:
            raise InputError(f"{type(self).__name__} ids lie in [0, {self.vocab_size}), got {invalid[:5]}")
        return values
