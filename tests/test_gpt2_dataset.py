"""GPT2Dataset samples, its index arrays and cache, and the train/valid/test split."""

import glob
import multiprocessing
import os
import time

import numpy as np
import pytest
import torch

from megatron.data.data_utils import (
    train_split_problem,
    train_split_shortfall,
    build_datasets_from_paths,
    build_train_valid_test_datasets,
    get_train_valid_test_split,
)
from megatron.data.gpt2_dataset import GPT2Dataset
from megatron.data.indexed_dataset import MMapIndexedDataset, MMapIndexedDatasetBuilder
from megatron.data.sample_index import build_sample_idx


def write_documents(prefix, documents):
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for tokens in documents:
        builder.add_item(np.asarray(tokens))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def make_documents(count=30, seed=0):
    """Documents of 1..40 tokens; token values encode (document, position) so any mix-up shows."""
    rng = np.random.default_rng(seed)
    return [[100 * d + p for p in range(int(rng.integers(1, 41)))] for d in range(count)]


@pytest.fixture
def corpus(tmp_path):
    documents = make_documents()
    return write_documents(str(tmp_path / "corpus"), documents), documents


def build(prefix, num_samples=50, seq_length=16, seed=1234, name="train", documents=None):
    indexed = MMapIndexedDataset(prefix)
    if documents is None:
        documents = np.arange(len(indexed))
    return GPT2Dataset(name, prefix, documents, indexed, num_samples, seq_length, seed)


def in_sample_order(dataset):
    """Samples in stream order, undoing the shuffle."""
    order = np.argsort(np.asarray(dataset.shuffle_idx))
    return [dataset[int(i)]["text"] for i in order]


def test_samples_have_seq_length_plus_one_int64_tokens(corpus):
    dataset = build(corpus[0])
    assert len(dataset) >= 50
    for i in range(len(dataset)):
        sample = dataset[i]["text"]
        assert sample.dtype == np.int64 and sample.shape == (17,)


def test_unshuffled_samples_are_the_token_stream_with_one_token_overlap(corpus):
    prefix, documents = corpus
    dataset = build(prefix, num_samples=120, seq_length=16)
    stream = np.concatenate([documents[d] for d in dataset.doc_idx])
    samples = in_sample_order(dataset)
    for previous, current in zip(samples, samples[1:]):
        assert previous[-1] == current[0]
    joined = np.concatenate([samples[0]] + [s[1:] for s in samples[1:]])
    np.testing.assert_array_equal(joined, stream[: len(joined)])
    assert len(stream) - len(joined) < 16


def test_every_epoch_is_a_permutation_of_the_split(corpus):
    documents = np.arange(5, 25)
    dataset = build(corpus[0], num_samples=200, documents=documents)
    epochs = np.asarray(dataset.doc_idx).reshape(-1, len(documents))
    assert len(epochs) > 1
    for epoch in epochs:
        np.testing.assert_array_equal(np.sort(epoch), documents)
    assert not all((epoch == epochs[0]).all() for epoch in epochs[1:])


def reference_sample_idx(sizes, doc_idx, seq_length, num_samples):
    """Walk the stream document by document, as Megatron's original helper does."""
    rows, position, offset = [(0, 0)], 0, 0
    for _ in range(num_samples):
        remaining = seq_length
        while remaining >= sizes[doc_idx[position]] - offset:
            remaining -= sizes[doc_idx[position]] - offset
            position, offset = position + 1, 0
        offset += remaining
        rows.append((position, offset))
    return np.array(rows)


def test_sample_idx_matches_a_document_walk():
    rng = np.random.default_rng(3)
    sizes = rng.integers(1, 30, size=40).astype(np.int32)
    doc_idx = rng.permutation(np.tile(np.arange(40, dtype=np.int32), 2))
    epoch_tokens = int(sizes.sum())
    sample_idx = build_sample_idx(sizes, doc_idx, 7, 2, epoch_tokens)
    assert len(sample_idx) == (2 * epoch_tokens - 1) // 7 + 1
    np.testing.assert_array_equal(sample_idx, reference_sample_idx(sizes, doc_idx, 7, len(sample_idx) - 1))


def cache_files(prefix):
    return sorted(glob.glob(prefix + "_*indexmap*.npy"))


def test_cache_reused_for_same_key_and_rebuilt_when_it_changes(corpus):
    prefix = corpus[0]
    first = build(prefix)
    files = cache_files(prefix)
    assert len(files) == 3
    assert all("_train_indexmap_50ns_16sl_1234s_" in f for f in files)
    stamps = [os.stat(f).st_mtime_ns for f in files]
    second = build(prefix)
    assert [os.stat(f).st_mtime_ns for f in files] == stamps
    np.testing.assert_array_equal(second.shuffle_idx, first.shuffle_idx)
    build(prefix, seq_length=8)
    build(prefix, seed=7)
    build(prefix, documents=np.arange(3, 20))
    assert len(cache_files(prefix)) == 12
    os.remove(files[0])
    build(prefix)
    assert len(cache_files(prefix)) == 12


def test_unreadable_cache_is_named(corpus):
    prefix = corpus[0]
    build(prefix)
    with open(cache_files(prefix)[0], "wb") as stream:
        stream.write(b"junk")
    with pytest.raises(ValueError, match="index cache .*unreadable.*delete it"):
        build(prefix)


def test_deterministic_and_seed_dependent(tmp_path):
    documents = make_documents()
    a = build(write_documents(str(tmp_path / "a"), documents))
    b = build(write_documents(str(tmp_path / "b"), documents))
    c = build(write_documents(str(tmp_path / "c"), documents), seed=99)
    for i in range(len(a)):
        np.testing.assert_array_equal(a[i]["text"], b[i]["text"])
    assert any((a[i]["text"] != c[i]["text"]).any() for i in range(len(a)))


def test_invalid_arguments(corpus):
    prefix = corpus[0]
    with pytest.raises(ValueError, match=r"must lie in \[0, 30\)"):
        build(prefix, documents=np.arange(25, 31))
    with pytest.raises(ValueError, match="non-empty"):
        build(prefix, documents=np.arange(0))
    with pytest.raises(IndexError, match="out of range"):
        build(prefix)[10_000]


def _distributed_rank(rank, prefix, init_file, results):
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        if rank == 0:
            time.sleep(1.0)  # rank 1 reaches the barrier first and must wait for the build
        dataset = build(prefix)
        results.put((rank, [dataset[i]["text"].tolist() for i in range(len(dataset))]))
    finally:
        torch.distributed.destroy_process_group()


def test_other_ranks_wait_for_rank_zero(corpus, tmp_path):
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    ranks = [
        context.Process(target=_distributed_rank, args=(r, corpus[0], str(tmp_path / "pg"), results)) for r in (0, 1)
    ]
    for process in ranks:
        process.start()
    samples = dict(results.get(timeout=60) for _ in ranks)
    for process in ranks:
        process.join(timeout=30)
        assert process.exitcode == 0
    assert samples[0] == samples[1]
    assert len(cache_files(corpus[0])) == 3


def _concurrent_job(prefix, results):
    """An independent job: counts its own builds of the index mappings."""
    from megatron.data import gpt2_dataset

    real_build, builds = gpt2_dataset._build_index_mappings, []

    def counting_build(*args):
        builds.append(1)
        time.sleep(0.5)  # widen the window in which the other jobs look for the cache
        return real_build(*args)

    gpt2_dataset._build_index_mappings = counting_build
    dataset = build(prefix)
    results.put((len(builds), [dataset[i]["text"].tolist() for i in range(len(dataset))]))


def test_jobs_starting_together_build_once_and_agree(corpus):
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    jobs = [context.Process(target=_concurrent_job, args=(corpus[0], results)) for _ in range(3)]
    for job in jobs:
        job.start()
    outcomes = [results.get(timeout=60) for _ in jobs]
    for job in jobs:
        job.join(timeout=30)
        assert job.exitcode == 0
    assert sum(builds for builds, _ in outcomes) == 1
    assert all(samples == outcomes[0][1] for _, samples in outcomes)
    assert len(cache_files(corpus[0])) == 3
    assert not glob.glob(corpus[0] + "*.tmp-*")


@pytest.mark.parametrize(
    "split, size, expected",
    [
        ("969,30,1", 1000, [0, 969, 999, 1000]),
        ("969,30,1", 100, [0, 97, 100, 100]),
        ("98/2/0", 50, [0, 49, 50, 50]),
        ("1", 10, [0, 10, 10, 10]),
        ("8,2", 10, [0, 8, 10, 10]),
        ("1,1,1", 10, [0, 4, 7, 10]),
        ("0,1,1", 3, [0, 0, 1, 3]),
    ],
)
def test_split_boundaries(split, size, expected):
    assert get_train_valid_test_split(split, size) == expected


@pytest.mark.parametrize("split", ["a,b", "1,2,3,4", "0,0,0", "-1,2"])
def test_bad_split_strings_are_named(split):
    with pytest.raises(ValueError, match=f'split "{split}"'):
        get_train_valid_test_split(split, 10)


def test_a_train_weight_of_zero_is_refused_though_rounding_gives_train_a_document():
    assert get_train_valid_test_split("0,50,50", 1597)[:2] == [0, 1]  # GPT-NeoX's rounding, kept for its indices
    assert "leaves the train split no documents (of 1597)" in train_split_problem("data", "0,50,50", 1597)
    assert train_split_problem("data", "1,999,0", 1000) is None


def test_a_train_split_shorter_than_one_global_batch_is_refused():
    sizes = np.full(1000, 50, dtype=np.int32)  # 50 tokens per document
    # "10,990,0": 10 documents, 500 tokens; a batch of 4 sequences of 64 tokens reads 257
    assert train_split_shortfall("data", "10,990,0", sizes, batch_sequences=4, seq_length=64) is None
    problem = train_split_shortfall("data", "10,990,0", sizes, batch_sequences=8, seq_length=64)
    assert problem == ("data_path = 'data' with split = '10,990,0' leaves the train split 10 documents of 500 tokens, "
                       "fewer than one global batch reads (8 sequences of 64 tokens: 513); give train a larger share "
                       "of split or use a dataset with more text")


def test_train_valid_test_datasets_cover_disjoint_document_ranges(corpus):
    prefix, documents = corpus
    train, valid, test = build_train_valid_test_datasets(prefix, "80,20,0", [40, 10, 5], seq_length=8, seed=1)
    assert test is None
    assert set(np.asarray(train.doc_idx)) == set(range(24))
    assert set(np.asarray(valid.doc_idx)) == set(range(24, 30))
    assert len(train) >= 40 and len(valid) >= 10


def test_datasets_from_separate_paths(tmp_path, corpus):
    other = write_documents(str(tmp_path / "valid"), make_documents(count=5, seed=1))
    train, valid, test = build_datasets_from_paths([corpus[0]], other, None, [20, 5, 0], seq_length=8, seed=1)
    assert test is None
    assert len(set(np.asarray(train.doc_idx))) == 30 and len(set(np.asarray(valid.doc_idx))) == 5
    with pytest.raises(ValueError, match="valid_data_weights has 1 entries but valid_data_paths has 2"):
        build_datasets_from_paths([corpus[0]], [other, other], None, [20, 5, 0], 8, 1, (None, [1.0], None))
