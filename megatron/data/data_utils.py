"""Train/valid/test datasets: one data prefix split by document ranges, or prefixes per split, blended by weight."""

from collections.abc import Sequence

import numpy as np

from megatron.cli import InputError
from megatron.data.blendable_dataset import BlendableDataset, blended_sample_counts
from megatron.data.gpt2_dataset import GPT2Dataset
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.sample_index import num_epochs_needed

SPLIT_NAMES = ("train", "valid", "test")
Dataset = GPT2Dataset | BlendableDataset
Datasets = tuple[Dataset | None, Dataset | None, Dataset | None]


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
        raise InputError(f'split "{split_string}" must be up to three numbers such as "969,30,1"') from None
    if len(weights) > 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise InputError(f'split "{split_string}" must be up to three non-negative weights with a positive sum')
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    boundaries = [0]
    for weight in weights:
        boundaries.append(boundaries[-1] + int(round(weight / total * size)))
    excess = boundaries[-1] - size
    return [0] + [min(max(b - excess, 0), size) for b in boundaries[1:]]


def train_split_problem(data_path: str, split: str, documents: int) -> str | None:
    """The error of a `split` that gives training no share, or leaves the train part of `documents` documents
    empty; None if it has some. (With a weight of 0, GPT-NeoX's rounding can still hand train one document, which
    a run would then repeat for its whole length.) deepy.py asks before launch (from the index header), the ranks
    again when they build the datasets."""
    boundaries = get_train_valid_test_split(split, documents)
    separator = "/" if "/" in split else ","
    if boundaries[1] > boundaries[0] and float(split.split(separator)[0]) > 0:
        return None
    return (f"data_path = {data_path!r} with split = {split!r} leaves the train split no documents (of {documents}); "
            f"give train a share of split (e.g. \"969,30,1\") or use a dataset with more documents")


def train_split_tokens(split: str, sizes: np.ndarray) -> tuple[int, int]:
    """The train split's documents and tokens, of documents of `sizes` tokens."""
    train_end = get_train_valid_test_split(split, len(sizes))[1]
    return train_end, int(np.sum(sizes[:train_end], dtype=np.int64))


def train_split_shortfall(data_path: str, split: str, sizes: np.ndarray, batch_sequences: int,
                          seq_length: int) -> str | None:
    """The error of a train split with fewer tokens than one global batch of sequences reads (so that every
    batch would repeat the same text); None if it has enough. `sizes`: every document's token count."""
    train_end, tokens = train_split_tokens(split, sizes)
    needed = batch_sequences * seq_length + 1
    if tokens >= needed:
        return None
    return (f"data_path = {data_path!r} with split = {split!r} leaves the train split {train_end} documents of "
            f"{tokens:,} tokens, fewer than one global batch reads ({batch_sequences} sequences of {seq_length} "
            f"tokens: {needed:,}); give train a larger share of split or use a dataset with more text")


# Beyond about four epochs, repeated text adds little over fresh text (Muennighoff et al., "Scaling
# Data-Constrained Language Models", 2023): more repeats than this get a note before launch.
NOTED_EPOCHS = 4


def train_split_repeats(data_path: str, split: str, sizes: np.ndarray, iterations: int, batch_sequences: int,
                        seq_length: int) -> str | None:
    """A note on a train split that `iterations` global batches read more than NOTED_EPOCHS times (as the
    dataset's epochs count them); None otherwise. Not an error: repeating a small corpus can be meant."""
    train_end, tokens = train_split_tokens(split, sizes)
    if tokens == 0:
        return None  # train_split_problem names it
    epochs = num_epochs_needed(tokens, seq_length, iterations * batch_sequences)
    if epochs <= NOTED_EPOCHS:
        return None
    return (f"data_path = {data_path!r} with split = {split!r} gives the train split {train_end} documents of "
            f"{tokens:,} tokens, which train_iters = {iterations} reads {epochs} times ({iterations} x "
            f"{batch_sequences} sequences of {seq_length} tokens); if that is not intended, give train a larger "
            "share of split or use more text")


def build_train_valid_test_datasets(
    data_prefix: str,
    split: str,
    train_valid_test_num_samples: Sequence[int],
    seq_length: int,
    seed: int,
) -> Datasets:
    """Split the documents of ``data_prefix`` by ``split``; a split with no documents gives None."""
    _check_num_samples(train_valid_test_num_samples)
    indexed_dataset = open_nonempty(data_prefix)
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
    train_valid_test_weights: Sequence[Sequence[float] | None] = (None, None, None),
) -> Datasets:
    """Whole data prefixes per split (``train_data_paths`` etc.); several are blended by their weights.

    Unset weights weigh each prefix by its token count (the natural mixture).
    A split without paths gives None.
    """
    _check_num_samples(train_valid_test_num_samples)
    datasets = []
    all_paths = (train_data_paths, valid_data_paths, test_data_paths)
    for name, paths, num_samples, weights in zip(
        SPLIT_NAMES, all_paths, train_valid_test_num_samples, train_valid_test_weights
    ):
        prefixes = [paths] if isinstance(paths, str) else list(paths or ())
        if weights is not None and len(weights) != len(prefixes):
            raise InputError(
                f"{name}_data_weights has {len(weights)} entries but {name}_data_paths has {len(prefixes)}; "
                f"give one weight per path"
            )
        datasets.append(_whole_or_blended(name, prefixes, weights, num_samples, seq_length, seed))
    return tuple(datasets)


def _whole_dataset(
    name: str, prefix: str, indexed_dataset: MMapIndexedDataset, num_samples: int, seq_length: int, seed: int
) -> GPT2Dataset:
    documents = np.arange(len(indexed_dataset), dtype=np.int64)
    return GPT2Dataset(name, prefix, documents, indexed_dataset, num_samples, seq_length, seed)


def _whole_or_blended(
    name: str, prefixes: list[str], weights: Sequence[float] | None, num_samples: int, seq_length: int, seed: int
) -> Dataset | None:
    if not prefixes:
        return None
    indexed = [open_nonempty(prefix) for prefix in prefixes]
    if len(prefixes) == 1:
        return _whole_dataset(name, prefixes[0], indexed[0], num_samples, seq_length, seed)
    if weights is None:
        weights = [float(np.sum(dataset.sizes, dtype=np.int64)) for dataset in indexed]
    counts = blended_sample_counts(weights, num_samples, prefixes[0], name)
    parts = [
        _whole_dataset(f"{name}_{index}", prefix, dataset, int(count), seq_length, seed)
        for index, (prefix, dataset, count) in enumerate(zip(prefixes, indexed, counts))
    ]
    return BlendableDataset(name, parts, weights, num_samples, prefixes[0])


def open_nonempty(prefix: str) -> MMapIndexedDataset:
    """The dataset at ``prefix``; a named error if it holds no documents, which no split could sample from."""
    dataset = MMapIndexedDataset(prefix)
    if len(dataset) == 0:
        raise InputError(
            f"{prefix}: the dataset holds no documents ({prefix}.idx lists 0 sequences); re-run "
            f"tools/preprocess_data.py on inputs that have text"
        )
    return dataset


def _check_num_samples(train_valid_test_num_samples: Sequence[int]) -> None:
    if len(train_valid_test_num_samples) != 3 or any(n < 0 for n in train_valid_test_num_samples):
        raise ValueError(
            f"train_valid_test_num_samples must be 3 non-negative counts, got {list(train_valid_test_num_samples)}"
        )
