"""Which dataset, and which of its samples, each sample of a blend reads.

Datasets are interleaved by virtual time: the k-th sample of dataset d is due
at ``(k + 0.5) / weight[d]`` and samples are taken in due order (ties go to
the lower dataset). After any n samples every dataset has contributed
``n * weight`` samples, give or take about ``number of datasets / 2``, and
the order is deterministic, so a resumed run sees the same blend.

``build_blending_indices`` runs the compiled helper (``helpers.cpp``) and
falls back to ``build_blending_indices_numpy``, which returns identical arrays.
"""

from collections.abc import Sequence

import numpy as np

from megatron.cli import InputError
from megatron.data.compiled_helpers import load_helpers

MAX_DATASETS = 1 << 16


def normalized_weights(weights: Sequence[float], what: str = "weights") -> np.ndarray:
    """Weights scaled to sum to 1; each must be a positive finite number."""
    values = np.asarray(weights, dtype=np.float64)
    if values.ndim != 1 or not 1 <= len(values) <= MAX_DATASETS:
        raise InputError(f"{what} must list 1 to {MAX_DATASETS} numbers, got {list(weights)}")
    if not np.all(np.isfinite(values)) or np.any(values <= 0):
        raise InputError(f"{what} must all be positive numbers, got {list(weights)}")
    return values / values.sum()


def most_samples_taken(weights: np.ndarray, num_samples: int) -> np.ndarray:
    """An upper bound on the samples a blend of ``num_samples`` takes from each dataset (normalized ``weights``):
    the n-th due time is at most n + len(weights) / 2."""
    return np.floor(num_samples * np.asarray(weights, dtype=np.float64) + len(weights)).astype(np.int64) + 2


def blending_build_bytes(num_samples: int) -> int:
    """Bytes of the two arrays build_blending_indices returns by the compiled helper (uint16 and int64 a sample)."""
    return num_samples * (np.dtype(np.uint16).itemsize + np.dtype(np.int64).itemsize)


def build_blending_indices(weights: np.ndarray, num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(uint16 dataset of each sample, int64 index of the sample within that dataset)."""
    weights = normalized_weights(weights)
    helpers = load_helpers()
    if helpers is None:
        return build_blending_indices_numpy(weights, num_samples)
    return helpers.build_blending_indices(weights, num_samples)


def build_blending_indices_numpy(weights: np.ndarray, num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """The same arrays by sorting every candidate's due time: enough candidates per dataset, then a stable sort.
    `weights` are used as given, as the compiled helper uses them (build_blending_indices normalized them once):
    normalizing again could move a due time by one rounding and break a tie the other way."""
    weights = np.asarray(weights, dtype=np.float64)
    if not np.all(weights > 0):
        raise ValueError(f"blending weights must be positive, got {list(weights)}")
    if num_samples < 0:
        raise ValueError(f"num_samples must be non-negative, got {num_samples}")
    candidates = most_samples_taken(weights, num_samples)
    due = np.concatenate(
        [(np.arange(count, dtype=np.float64) + 0.5) / weight for count, weight in zip(candidates, weights)]
    )
    order = np.argsort(due, kind="stable")[:num_samples]
    starts = np.concatenate([[0], np.cumsum(candidates)[:-1]])
    dataset_index = (np.searchsorted(starts, order, side="right") - 1).astype(np.uint16)
    dataset_sample_index = order - starts[dataset_index]
    return dataset_index, dataset_sample_index
