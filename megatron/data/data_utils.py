"""Train/valid/test datasets from one data prefix split by weights, or from one prefix per split."""

from collections.abc import Sequence

import numpy as np

from megatron.data.gpt2_dataset import GPT2Dataset
from megatron.data.indexed_dataset import MMapIndexedDataset

SPLIT_NAMES = ("train", "valid", "test")
Datasets = tuple[GPT2Dataset | None, GPT2Dataset | None, GPT2Dataset | None]


def get_train_valid_test_split(split_string: str, size: int) -> list[int]:
    """Document boundaries ``[0, train_end, valid_end, size]`` for a GPT-NeoX split such as "969,30,1".

    Up to three weights separated by "," or "/" (missing ones are 0) are
    normalised to fractions of ``size`` documents. As in GPT-NeoX each part is
    rounded on its own and the rounding excess is taken off every boundary.
    """
    separator = "/" if "/" in split_string else ","
    try:
        weights = [float(part) for part in split_string.split(separator)]
    except ValueError:
        raise ValueError(f'split "{split_string}" must be up to three numbers such as "969,30,1"') from None
    if len(weights) > 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f'split "{split_string}" must be up to three non-negative weights with a positive sum')
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    boundaries = [0]
    for weight in weights:
        boundaries.append(boundaries[-1] + int(round(weight / total * size)))
    excess = boundaries[-1] - size
    return [0] + [min(max(b - excess, 0), size) for b in boundaries[1:]]


def build_train_valid_test_datasets(
    data_prefix: str,
    split: str,
    train_valid_test_num_samples: Sequence[int],
    seq_length: int,
    seed: int,
) -> Datasets:
    """Split the documents of ``data_prefix`` by ``split``; a split with no documents gives None."""
    _check_num_samples(train_valid_test_num_samples)
    indexed_dataset = MMapIndexedDataset(data_prefix)
    boundaries = get_train_valid_test_split(split, len(indexed_dataset))
    datasets = []
    for index, name in enumerate(SPLIT_NAMES):
        start, stop = boundaries[index], boundaries[index + 1]
        if stop <= start:
            datasets.append(None)
            continue
        documents = np.arange(start, stop, dtype=np.int64)
        datasets.append(
            GPT2Dataset(
                name, data_prefix, documents, indexed_dataset, train_valid_test_num_samples[index], seq_length, seed
            )
        )
    return tuple(datasets)


def build_datasets_from_paths(
    train_data_paths: str | Sequence[str] | None,
    valid_data_paths: str | Sequence[str] | None,
    test_data_paths: str | Sequence[str] | None,
    train_valid_test_num_samples: Sequence[int],
    seq_length: int,
    seed: int,
) -> Datasets:
    """One whole data prefix per split (``train_data_paths`` etc.); a missing split gives None."""
    _check_num_samples(train_valid_test_num_samples)
    datasets = []
    for index, (name, paths) in enumerate(zip(SPLIT_NAMES, (train_data_paths, valid_data_paths, test_data_paths))):
        prefix = _single_path(f"{name}_data_paths", paths)
        if prefix is None:
            datasets.append(None)
            continue
        indexed_dataset = MMapIndexedDataset(prefix)
        documents = np.arange(len(indexed_dataset), dtype=np.int64)
        datasets.append(
            GPT2Dataset(name, prefix, documents, indexed_dataset, train_valid_test_num_samples[index], seq_length, seed)
        )
    return tuple(datasets)


def _single_path(key: str, paths: str | Sequence[str] | None) -> str | None:
    if paths is None or isinstance(paths, str):
        return paths or None
    if len(paths) > 1:
        raise ValueError(
            f"{key} lists {len(paths)} paths {list(paths)}: "
            f"blending several datasets is not supported yet; give one path"
        )
    return paths[0] if paths else None


def _check_num_samples(train_valid_test_num_samples: Sequence[int]) -> None:
    if len(train_valid_test_num_samples) != 3 or any(n < 0 for n in train_valid_test_num_samples):
        raise ValueError(
            f"train_valid_test_num_samples must be 3 non-negative counts, got {list(train_valid_test_num_samples)}"
        )
