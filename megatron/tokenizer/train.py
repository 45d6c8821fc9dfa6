"""Train a tokenizer on an iterable of documents: byte-level BPE (``tokenizer.json``) or SentencePiece (``.model``).

Both round-trip every string exactly: byte-level BPE by construction, and
SentencePiece with byte fallback, no normalisation and whitespace kept. Both
carry GPT-NeoX's ``<|endoftext|>`` (eod) and ``<|padding|>`` (pad) tokens.
"""

import io
import os
from collections.abc import Iterable, Iterator

import sentencepiece
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from megatron.cli import InputError

EOD_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|padding|>"
SENTENCEPIECE_MODEL_TYPES = ("unigram", "bpe")
# SentencePiece reads sentences: documents are cut into lines of at most this many bytes.
_MAX_SENTENCE_BYTES = 4096
_SENTENCEPIECE_SPECIALS = 4  # unk, bos, eos, pad


def minimum_vocab_size(kind: str) -> int:
    """Smallest vocabulary of a ``"bpe"`` or ``"sentencepiece"`` model that still covers every byte and the specials."""
    byte_level = len(pre_tokenizers.ByteLevel.alphabet())
    return byte_level + 2 if kind == "bpe" else 256 + _SENTENCEPIECE_SPECIALS


def _write_atomically(path: str, content: bytes) -> None:
    temporary = path + ".partial"
    with open(temporary, "wb") as stream:
        stream.write(content)
    os.replace(temporary, path)


def train_byte_level_bpe(documents: Iterable[str], vocab_size: int, output_path: str) -> None:
    """A GPT-NeoX-style ``tokenizer.json``: byte-level BPE with eod id 0 and pad id 1."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer)
    _write_atomically(output_path, tokenizer.to_str(pretty=True).encode("utf-8"))


def _sentences(documents: Iterable[str]) -> Iterator[str]:
    for document in documents:
        for line in document.splitlines():
            encoded = line.encode("utf-8")
            for start in range(0, len(encoded), _MAX_SENTENCE_BYTES):
                piece = encoded[start : start + _MAX_SENTENCE_BYTES].decode("utf-8", errors="ignore")
                if piece.strip():
                    yield piece


def train_sentencepiece(documents: Iterable[str], vocab_size: int, model_type: str, output_path: str) -> None:
    """A SentencePiece ``.model`` (unigram or BPE) whose eos is ``<|endoftext|>`` and pad ``<|padding|>``."""
    if model_type not in SENTENCEPIECE_MODEL_TYPES:
        raise InputError(f"SentencePiece model_type must be one of {SENTENCEPIECE_MODEL_TYPES}, got {model_type!r}")
    model = io.BytesIO()
    try:
        _train_sentencepiece(documents, vocab_size, model_type, model)
    except RuntimeError as error:
        raise InputError(f"SentencePiece training failed (vocab_size {vocab_size}): {error}") from error
    _write_atomically(output_path, model.getvalue())


def _train_sentencepiece(documents: Iterable[str], vocab_size: int, model_type: str, model: io.BytesIO) -> None:
    """SentencePiece also keeps a piece per distinct character it sees: small vocabularies may not fit them."""
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=_sentences(documents),
        model_writer=model,
        vocab_size=vocab_size,
        model_type=model_type,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        eos_piece=EOD_TOKEN,
        pad_id=3,
        pad_piece=PAD_TOKEN,
        hard_vocab_limit=False,
        num_threads=os.cpu_count() or 1,
        minloglevel=2,
    )

