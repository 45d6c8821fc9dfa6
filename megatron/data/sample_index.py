"""The three index arrays behind a GPT-2 style dataset (Megatron / GPT-NeoX semantics).

The documents of a split are read epoch after epoch as one token stream;
sample ``i`` is the ``seq_length + 1`` tokens starting at stream position
``i * seq_length``, so neighbouring samples share one token (the last input
of one is the first label of the next) and samples cross document borders.

* doc_idx: the split's documents repeated ``num_epochs`` times, each epoch
  shuffled on its own, so every document appears once per epoch.
* sample_idx: ``[num_samples + 1, 2]`` rows of (position in doc_idx, token
  offset in that document) for the first token of every sample; row
  ``i + 1`` is also where sample ``i`` ends (inclusive).
* shuffle_idx: a permutation of the samples, the order training reads them.

``build_sample_idx`` runs the compiled helper (``helpers.cpp``: one pass, no
temporaries) and falls back to ``build_sample_idx_numpy``, which returns the
identical array using several times the memory. ``index_build_bytes`` counts what a build allocates without
building it (deepy.py bounds it by the machine's memory before launch).
"""

from dataclasses import dataclass

import numpy as np

from megatron.cli import InputError
from megatron.data.compiled_helpers import load_helpers


def tokens_per_epoch(documents: np.ndarray, sizes: np.ndarray) -> int:
    return int(np.sum(sizes[documents], dtype=np.int64))


def num_epochs_needed(epoch_tokens: int, seq_length: int, num_samples: int) -> int:
    """Fewest epochs holding ``num_samples`` samples: each takes seq_length new tokens, plus one at the very end."""
    if epoch_tokens <= 0:
        raise InputError("the documents of this split hold no tokens, so no sample can be built")
    needed_tokens = num_samples * seq_length + 1
    return -(-needed_tokens // epoch_tokens)


def doc_idx_dtype(largest_document: int) -> type[np.signedinteger]:
    """int32 while the document numbers fit it."""
    return np.int32 if largest_document < np.iinfo(np.int32).max else np.int64


def build_doc_idx(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState) -> np.ndarray:
    """``documents`` repeated ``num_epochs`` times, each epoch in its own random order."""
    epoch = np.asarray(documents, dtype=doc_idx_dtype(int(np.max(documents)) if len(documents) else 0))
    return np.concatenate([rng.permutation(epoch) for _ in range(num_epochs)])


def build_sample_idx(
    sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_epochs: int, epoch_tokens: int
) -> np.ndarray:
    """``build_sample_idx_numpy``'s result, from the compiled helper when it is available."""
    helpers = load_helpers()
    if helpers is None:
        return build_sample_idx_numpy(sizes, doc_idx, seq_length, num_epochs, epoch_tokens)
    sizes = np.ascontiguousarray(sizes, dtype=np.int32)
    doc_idx = np.ascontiguousarray(doc_idx, dtype=doc_idx.dtype if doc_idx.dtype == np.int32 else np.int64)
    return helpers.build_sample_idx(sizes, doc_idx, seq_length, num_epochs, epoch_tokens)


def build_sample_idx_numpy(
    sizes: np.ndarray, doc_idx: np.ndarray, seq_length: int, num_epochs: int, epoch_tokens: int
) -> np.ndarray:
    """(doc_idx position, token offset) where each sample starts, plus the end row.

    ``sizes`` are the tokens per document and ``doc_idx`` the document order.
    Returns int64 ``[num_samples + 1, 2]`` with ``num_samples =
    (num_epochs * epoch_tokens - 1) // seq_length``. Every position lies inside
    a non-empty document, so offsets are always smaller than its size.
    """
    num_samples = (num_epochs * epoch_tokens - 1) // seq_length
    doc_lengths = np.asarray(sizes)[doc_idx].astype(np.int64)
    doc_ends = np.cumsum(doc_lengths)
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    positions = np.searchsorted(doc_ends, starts, side="right")
    sample_idx = np.empty((num_samples + 1, 2), dtype=np.int64)
    sample_idx[:, 0] = positions
    sample_idx[:, 1] = starts - (doc_ends[positions] - doc_lengths[positions])
    return sample_idx


def shuffle_idx_dtype(num_samples: int) -> type[np.integer]:
    """uint32 while the sample numbers fit it."""
    return np.uint32 if num_samples < np.iinfo(np.uint32).max - 1 else np.int64


def build_shuffle_idx(num_samples: int, rng: np.random.RandomState) -> np.ndarray:
    """A random permutation of ``range(num_samples)``, uint32 while that suffices."""
    shuffle_idx = np.arange(num_samples, dtype=shuffle_idx_dtype(num_samples))
    rng.shuffle(shuffle_idx)
    return shuffle_idx


@dataclass(frozen=True)
class IndexBytes:
    """What building one dataset's index allocates (bytes), before its arrays are saved and memory-mapped."""

    epochs: int
    doc_idx: int
    sample_idx: int
    shuffle_idx: int

    @property
    def peak(self) -> int:
        """The most at one time: doc_idx twice while its epochs are concatenated, then all three arrays while
        the samples are shuffled."""
        return max(2 * self.doc_idx, self.doc_idx + self.sample_idx + self.shuffle_idx)


def index_build_bytes(num_documents: int, epoch_tokens: int, seq_length: int, num_samples: int) -> IndexBytes:
    """The arrays the compiled helper's build of ``num_samples`` samples of documents 0 .. num_documents - 1 (a
    train split, a whole dataset) of ``epoch_tokens`` tokens allocates, counted without building them."""
    epochs = num_epochs_needed(epoch_tokens, seq_length, num_samples)
    samples = (epochs * epoch_tokens - 1) // seq_length
    return IndexBytes(epochs=epochs,
                      doc_idx=epochs * num_documents * np.dtype(doc_idx_dtype(num_documents - 1)).itemsize,
                      sample_idx=(samples + 1) * 2 * np.dtype(np.int64).itemsize,
                      shuffle_idx=samples * np.dtype(shuffle_idx_dtype(samples)).itemsize)
