"""GPT-2 style dataset: ``seq_length + 1`` token samples cut from a split's documents read as one stream.

The index arrays (see ``sample_index``) are cached as ``.npy`` files beside
the data, named by everything that changes them, so a restart reuses them and
any change of split, length, sample count, seed or data rebuilds them
(``index_cache``: one process builds, the others wait and load).
"""

import hashlib
import logging
import time

import numpy as np
import torch

from megatron.cli import InputError
from megatron.data.index_cache import load_or_build
from megatron.data.indexed_dataset import MMapIndexedDataset, data_file_path
from megatron.data.sample_index import (
    build_doc_idx,
    build_sample_idx,
    build_shuffle_idx,
    num_epochs_needed,
    tokens_per_epoch,
)

logger = logging.getLogger(__name__)

INDEX_KINDS = ("doc_idx", "sample_idx", "shuffle_idx")


class GPT2Dataset(torch.utils.data.Dataset):
    """``dataset[i] == {"text": int64 array of seq_length + 1 tokens}``, in shuffled order.

    ``documents`` are the sequence indices of ``indexed_dataset`` in this split;
    ``num_samples`` is a lower bound: the dataset holds every sample of the
    whole epochs needed to reach it.
    """

    def __init__(
        self,
        name: str,
        data_prefix: str,
        documents: np.ndarray,
        indexed_dataset: MMapIndexedDataset,
        num_samples: int,
        seq_length: int,
        seed: int,
    ):
        documents = np.asarray(documents, dtype=np.int64)
        if documents.ndim != 1 or documents.size == 0:
            raise ValueError(f"{name} split of {data_prefix}: documents must be a non-empty 1-D array")
        if documents.min() < 0 or documents.max() >= len(indexed_dataset):
            raise ValueError(
                f"{name} split of {data_prefix}: document indices must lie in [0, {len(indexed_dataset)}), "
                f"got [{documents.min()}, {documents.max()}]"
            )
        if seq_length < 1 or num_samples < 0:
            raise ValueError(
                f"{name} split: need seq_length >= 1 and num_samples >= 0, got {seq_length}, {num_samples}"
            )
        self.name = name
        self.indexed_dataset = indexed_dataset
        self.seq_length = seq_length
        self.doc_idx, self.sample_idx, self.shuffle_idx = _load_or_build_index_mappings(
            name, data_prefix, documents, indexed_dataset.sizes, num_samples, seq_length, seed
        )

    def __len__(self) -> int:
        return len(self.shuffle_idx)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        pieces = self.pieces(idx)
        tokens = pieces[0][1] if len(pieces) == 1 else np.concatenate([tokens for _, tokens in pieces])
        return {"text": tokens.astype(np.int64)}

    def pieces(self, idx: int) -> list[tuple[int, np.ndarray]]:
        """Sample `idx` as the (document, its tokens in the sample) it is cut from, in order: where each token
        came from, for an error about it."""
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for the {self.name} dataset of {len(self)} samples")
        sample = int(self.shuffle_idx[idx])
        first, first_offset = (int(v) for v in self.sample_idx[sample])
        last, last_offset = (int(v) for v in self.sample_idx[sample + 1])
        read = self.indexed_dataset.get
        if first == last:
            document = int(self.doc_idx[first])
            return [(document, read(document, first_offset, last_offset - first_offset + 1))]
        documents = [int(document) for document in self.doc_idx[first:last + 1]]
        pieces = [(documents[0], read(documents[0], first_offset))]
        pieces += [(document, read(document)) for document in documents[1:-1]]
        pieces.append((documents[-1], read(documents[-1], 0, last_offset + 1)))
        return pieces

    @property
    def data_file(self) -> str:
        """The .bin file the samples are read from."""
        return data_file_path(self.indexed_dataset.prefix)


def index_cache_paths(
    data_prefix: str, name: str, documents: np.ndarray, epoch_tokens: int, num_samples: int, seq_length: int, seed: int
) -> dict[str, str]:
    """The three cache files; the hash covers the document range and its token count (i.e. the data itself)."""
    digest = hashlib.sha1(np.ascontiguousarray(documents, dtype=np.int64))
    digest.update(str(epoch_tokens).encode())
    stem = f"{data_prefix}_{name}_indexmap_{num_samples}ns_{seq_length}sl_{seed}s_{digest.hexdigest()[:10]}dh"
    return {kind: f"{stem}_{kind}.npy" for kind in INDEX_KINDS}


def _load_or_build_index_mappings(
    name: str,
    data_prefix: str,
    documents: np.ndarray,
    sizes: np.ndarray,
    num_samples: int,
    seq_length: int,
    seed: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    epoch_tokens = tokens_per_epoch(documents, sizes)
    if epoch_tokens == 0:
        raise InputError(f"the {name} split of {data_prefix} holds no tokens; check the data and the split")
    paths = index_cache_paths(data_prefix, name, documents, epoch_tokens, num_samples, seq_length, seed)
    arrays = load_or_build(
        paths, lambda: _build_index_mappings(name, documents, sizes, epoch_tokens, num_samples, seq_length, seed, paths)
    )
    return tuple(arrays[kind] for kind in INDEX_KINDS)


def _build_index_mappings(
    name: str,
    documents: np.ndarray,
    sizes: np.ndarray,
    epoch_tokens: int,
    num_samples: int,
    seq_length: int,
    seed: int,
    paths: dict[str, str],
) -> dict[str, np.ndarray]:
    start = time.time()
    rng = np.random.RandomState(seed)
    num_epochs = num_epochs_needed(epoch_tokens, seq_length, num_samples)
    doc_idx = build_doc_idx(documents, num_epochs, rng)
    sample_idx = build_sample_idx(sizes, doc_idx, seq_length, num_epochs, epoch_tokens)
    shuffle_idx = build_shuffle_idx(len(sample_idx) - 1, rng)
    logger.info(
        "built %s index mappings: %d samples over %d epochs in %.2f s (%s)",
        name, len(shuffle_idx), num_epochs, time.time() - start, paths["doc_idx"],
    )
    return dict(zip(INDEX_KINDS, (doc_idx, sample_idx, shuffle_idx)))
