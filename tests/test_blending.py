"""Blending several datasets: proportions, exact samples, caching, and the training-side wiring."""

import glob
import os
from types import SimpleNamespace

import numpy as np
import pytest

from megatron.data.blendable_dataset import BlendableDataset
from megatron.data.blending_index import build_blending_indices
from megatron.data.data_utils import build_datasets_from_paths
from megatron.data.gpt2_dataset import GPT2Dataset
from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from megatron.training.data import build_datasets

SEQ_LENGTH = 8


def write_source(prefix, source, count=40):
    """Documents whose every token is 1000 * source + something < 1000: a sample tells where it came from."""
    rng = np.random.default_rng(source)
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for _ in range(count):
        builder.add_item(1000 * source + rng.integers(0, 1000, size=int(rng.integers(5, 30))))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.fixture
def sources(tmp_path):
    return [write_source(str(tmp_path / f"source{s}"), s, count=20 + 15 * s) for s in range(3)]


def source_of(sample):
    origins = set((np.asarray(sample["text"]) // 1000).tolist())
    assert len(origins) == 1
    return origins.pop()


def test_observed_proportions_within_one_percent(sources):
    weights = [0.5, 0.3, 0.2]
    train, _, _ = build_datasets_from_paths(sources, None, None, [4000, 0, 0], SEQ_LENGTH, 7, (weights, None, None))
    assert isinstance(train, BlendableDataset) and len(train) == 4000
    origins = np.array([source_of(train[i]) for i in range(len(train))])
    for prefix_length in (500, 1000, 4000):
        observed = np.bincount(origins[:prefix_length], minlength=3) / prefix_length
        np.testing.assert_allclose(observed, weights, atol=0.01)


def test_blend_sample_is_the_component_sample(sources):
    parts = [
        GPT2Dataset(f"part{i}", prefix, np.arange(len(MMapIndexedDataset(prefix))), MMapIndexedDataset(prefix), 200,
                    SEQ_LENGTH, 3)
        for i, prefix in enumerate(sources)
    ]
    blend = BlendableDataset("train", parts, [2, 1, 1], 300, sources[0])
    for i in range(len(blend)):
        dataset = parts[int(blend.dataset_index[i])]
        np.testing.assert_array_equal(blend[i]["text"], dataset[int(blend.dataset_sample_index[i])]["text"])
    with pytest.raises(ValueError, match="reads .* samples of dataset 0 but it has only"):
        BlendableDataset("big", parts, [1, 1e-6, 1e-6], 10 * len(parts[0]), sources[0])
    with pytest.raises(IndexError, match="out of range"):
        blend[300]


def blend_cache_files(prefix):
    return sorted(glob.glob(prefix + "_*_blend_*.npy"))


def test_blend_cache_reused_and_rebuilt_when_weights_or_size_change(sources):
    first = build_datasets_from_paths(sources, None, None, [500, 0, 0], SEQ_LENGTH, 1, ([1, 2, 3], None, None))[0]
    files = blend_cache_files(sources[0])
    assert len(files) == 2
    stamps = [os.stat(f).st_mtime_ns for f in files]
    again = build_datasets_from_paths(sources, None, None, [500, 0, 0], SEQ_LENGTH, 1, ([1, 2, 3], None, None))[0]
    assert [os.stat(f).st_mtime_ns for f in files] == stamps
    np.testing.assert_array_equal(again.dataset_index, first.dataset_index)
    build_datasets_from_paths(sources, None, None, [500, 0, 0], SEQ_LENGTH, 1, ([3, 2, 1], None, None))
    build_datasets_from_paths(sources, None, None, [600, 0, 0], SEQ_LENGTH, 1, ([1, 2, 3], None, None))
    assert len(blend_cache_files(sources[0])) == 6


def test_unset_weights_follow_token_counts(sources):
    train = build_datasets_from_paths(sources, None, None, [3000, 0, 0], SEQ_LENGTH, 1)[0]
    tokens = np.array([MMapIndexedDataset(p).sizes.sum() for p in sources], dtype=np.float64)
    np.testing.assert_allclose(train.weights, tokens / tokens.sum())


def test_weights_must_be_positive(sources):
    for weights, message in (([1, -1, 1], "positive"), ([1, 0, 1], "positive"), ([1, float("nan"), 1], "positive")):
        with pytest.raises(ValueError, match=message):
            build_datasets_from_paths(sources, None, None, [10, 0, 0], SEQ_LENGTH, 1, (weights, None, None))


def test_blend_order_is_deterministic_and_fair_early_on():
    dataset_index, dataset_sample_index = build_blending_indices(np.array([0.7, 0.2, 0.1]), 100)
    # due times: dataset 0 at 0.71, 2.14, 3.57, 5.0, 6.43, 7.86, 9.29; 1 at 2.5, 7.5; 2 at 5.0 (tie: lower first)
    assert dataset_index[:10].tolist() == [0, 0, 1, 0, 0, 2, 0, 1, 0, 0]
    for source in range(3):
        np.testing.assert_array_equal(dataset_sample_index[dataset_index == source],
                                      np.arange((dataset_index == source).sum()))


def test_training_config_builds_blends_and_single_paths(sources):
    cfg = SimpleNamespace(
        train_batch_size=4, train_iters=50, eval_iters=5, seq_length=SEQ_LENGTH, seed=1234, data_path=None,
        split="969, 30, 1", train_data_paths=sources, valid_data_paths=sources[:1], test_data_paths=None,
        train_data_weights=[1.0, 1.0, 2.0], valid_data_weights=None, test_data_weights=None,
    )
    splits = build_datasets(cfg)
    assert isinstance(splits.train, BlendableDataset) and len(splits.train) == 200
    np.testing.assert_allclose(splits.train.weights, [0.25, 0.25, 0.5])
    assert isinstance(splits.valid, GPT2Dataset) and splits.test is None
