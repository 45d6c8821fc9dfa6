"""Datasets and per-rank batch iterators for training and evaluation.

Each data-parallel rank reads its own slice of every global batch. The training
iterator starts at `consumed_samples`, so a resumed run reads exactly the
samples an uninterrupted run would. Evaluation always reads the *first*
`eval_iters` global batches of the validation split, so every evaluation of
every run and layout scores the same tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset

from megatron.data.data_utils import (
    build_datasets_from_paths,
    build_train_valid_test_datasets,
    train_split_problem,
)
from megatron.data.indexed_dataset import index_file_path, read_index_header
from megatron.data.token_ids import check_token_ids
from megatron.data.samplers import PretrainingSampler


@dataclass
class Splits:
    train: Dataset | None
    valid: Dataset | None
    test: Dataset | None


def build_datasets(cfg) -> Splits:
    global_batch = cfg.train_batch_size
    num_samples = [
        cfg.train_iters * global_batch,
        cfg.eval_iters * global_batch,
        cfg.eval_iters * global_batch,
    ]
    if cfg.train_data_paths:
        datasets = build_datasets_from_paths(
            cfg.train_data_paths,
            cfg.valid_data_paths,
            cfg.test_data_paths,
            num_samples,
            cfg.seq_length,
            cfg.seed,
            (cfg.train_data_weights, cfg.valid_data_weights, cfg.test_data_weights),
        )
    else:
        datasets = build_train_valid_test_datasets(
            cfg.data_path, cfg.split, num_samples, cfg.seq_length, cfg.seed
        )
        if datasets[0] is None and cfg.train_iters > 0 and not cfg.eval_only:
            documents = read_index_header(index_file_path(cfg.data_path)).num_sequences
            raise ValueError(train_split_problem(cfg.data_path, cfg.split, documents))
    return Splits(*datasets)


def batch_iterator(
    dataset: Dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int,
    vocab_size: int | None = None,
) -> Iterator[torch.Tensor]:
    """Yields this rank's micro-batches of token ids [micro_batch, seq_length + 1]; with `vocab_size`, each batch
    checked on the host first (TokenIdError for an id outside the vocabulary: data/token_ids.py)."""
    sampler = PretrainingSampler(
        total_samples=len(dataset),
        consumed_samples=consumed_samples,
        micro_batch_size=micro_batch_size,
        data_parallel_rank=dp_rank,
        data_parallel_size=dp_size,
    )
    return _batches(dataset, sampler, vocab_size)


def _batches(dataset: Dataset, sampler: PretrainingSampler, vocab_size: int | None) -> Iterator[torch.Tensor]:
    """Read in this process, in order: no worker processes, and no seed drawn from the global RNG (which a resumed
    run restores from its checkpoint: dropout masks would shift)."""
    for samples in sampler:
        batch = np.stack([dataset[index]["text"] for index in samples]).astype(np.int64, copy=False)
        if vocab_size is not None:
            check_token_ids(batch, dataset, samples, vocab_size)
        yield torch.from_numpy(batch)
