"""Several datasets read as one, each sample drawn from them in proportion to their weights."""

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

from megatron.cli import InputError
from megatron.data.blending_index import build_blending_indices, normalized_weights
from megatron.data.index_cache import load_or_build

BLEND_KINDS = ("dataset_index", "dataset_sample_index")


def blend_cache_paths(cache_prefix: str, name: str, weights: np.ndarray, num_samples: int) -> dict[str, str]:
    """Cache files named by the sample count and a hash of the exact weights."""
    digest = hashlib.sha1(np.ascontiguousarray(weights, dtype=np.float64)).hexdigest()[:10]
    stem = f"{cache_prefix}_{name}_blend_{num_samples}ns_{len(weights)}ds_{digest}wh"
    return {kind: f"{stem}_{kind}.npy" for kind in BLEND_KINDS}


def blended_sample_counts(weights: Sequence[float], num_samples: int, cache_prefix: str, name: str) -> np.ndarray:
    """How many samples of each dataset a blend of ``num_samples`` reads: build each dataset with that many."""
    dataset_index, _ = _blending_indices(normalized_weights(weights), num_samples, cache_prefix, name)
    return np.bincount(dataset_index, minlength=len(weights))


def _blending_indices(weights: np.ndarray, num_samples: int, cache_prefix: str, name: str) -> tuple[np.ndarray, ...]:
    paths = blend_cache_paths(cache_prefix, name, weights, num_samples)
    arrays = load_or_build(paths, lambda: dict(zip(BLEND_KINDS, build_blending_indices(weights, num_samples))))
    return tuple(arrays[kind] for kind in BLEND_KINDS)


class BlendableDataset(torch.utils.data.Dataset):
    """``num_samples`` samples interleaved from ``datasets`` by ``weights`` (see ``blending_index``).

    The blend's index arrays are cached beside ``cache_prefix`` (the first
    dataset's prefix) like a GPT2Dataset's, so every rank maps one copy.
    """

    def __init__(
        self,
        name: str,
        datasets: Sequence[torch.utils.data.Dataset],
        weights: Sequence[float],
        num_samples: int,
        cache_prefix: str,
    ):
        if len(datasets) != len(weights):
            raise InputError(f"{name}: {len(datasets)} datasets but {len(weights)} weights; give one weight each")
        self.name = name
        self.datasets = list(datasets)
        self.weights = normalized_weights(weights, f"{name} data weights")
        self.dataset_index, self.dataset_sample_index = _blending_indices(
            self.weights, num_samples, cache_prefix, name
        )
        needed = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for position, (dataset, count) in enumerate(zip(self.datasets, needed)):
            if count > len(dataset):
                raise ValueError(
                    f"{name}: the blend reads {count} samples of dataset {position} but it has only {len(dataset)}; "
                    f"build it with blended_sample_counts(...)[{position}] samples"
                )

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        dataset, sample = self.source(idx)
        return dataset[sample]

    def source(self, idx: int) -> tuple[torch.utils.data.Dataset, int]:
        """The dataset sample `idx` of the blend is drawn from, and its index there."""
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for the {self.name} blend of {len(self)} samples")
        return self.datasets[int(self.dataset_index[idx])], int(self.dataset_sample_index[idx])
