"""Token ids checked on the host, batch by batch, before a batch goes to the device.

The launch check (dataset_check.py) takes the largest id from PREFIX.stats.json, which counts while the .bin keeps
the size and mtime it records: an edit in place that keeps both, or bit rot, passes it. An id at or above the
padded vocabulary would then be embedded as zeros, its loss be infinite, and every step be skipped naming no
cause. One max of each batch the loader holds as a NumPy array costs no device synchronisation; only a batch
that fails it is searched for the document to name.
"""

from __future__ import annotations

import numpy as np
import torch

from megatron.data.blendable_dataset import BlendableDataset
from megatron.data.dataset_check import stats_file_path


class TokenIdError(ValueError):
    """A batch holds a token id outside the vocabulary: an error of the rank that read it (the others read other
    samples), whose message names the file, the document, the id and the vocabulary size."""


def check_token_ids(batch: np.ndarray, dataset: torch.utils.data.Dataset, samples: list[int], vocab_size: int) -> None:
    """TokenIdError if `batch`, the samples `samples` of `dataset`, holds an id outside [0, vocab_size)."""
    if 0 <= batch.min() and batch.max() < vocab_size:
        return
    for sample in samples:
        source, index = dataset.source(sample) if isinstance(dataset, BlendableDataset) else (dataset, sample)
        for document, tokens in source.pieces(index):
            outside = _outside(tokens, vocab_size)
            if outside.size:
                raise TokenIdError(_message(source.data_file, document, int(outside[0]), vocab_size))
    raise TokenIdError(f"a batch held token id {int(_outside(batch, vocab_size)[0])}, outside the padded vocabulary "
                       f"of {vocab_size} rows, which its samples read again do not hold: the data files changed while "
                       "the run read them")


def _outside(tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    return tokens[(tokens < 0) | (tokens >= vocab_size)]


def _message(data_file: str, document: int, token_id: int, vocab_size: int) -> str:
    prefix = data_file.removesuffix(".bin")
    return (f"{data_file}: document {document} holds token id {token_id}, outside the padded vocabulary of "
            f"{vocab_size} rows; the file changed since {stats_file_path(prefix)} was written (it keeps its size "
            "and time), or was made with another tokenizer: rebuild it with tools/preprocess_data.py and this "
            "run's tokenizer (vocab_file)")
