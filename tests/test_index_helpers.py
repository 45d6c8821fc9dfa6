"""The compiled index builders (helpers.cpp) return exactly what their NumPy twins return."""

import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron.data import compiled_helpers
from megatron.data.blending_index import build_blending_indices_numpy
from megatron.data.sample_index import build_sample_idx_numpy


@pytest.fixture(scope="module")
def helpers():
    module = compiled_helpers.load_helpers()
    assert module is not None, "helpers.cpp did not compile; see the logged warning"
    return module


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 60), min_size=1, max_size=40).filter(any),
    seq_length=st.integers(1, 90),
    num_epochs=st.integers(1, 3),
    seed=st.integers(0, 2**31),
    wide=st.booleans(),
)
def test_sample_idx_identical(helpers, sizes, seq_length, num_epochs, seed, wide):
    sizes = np.asarray(sizes, dtype=np.int32)
    rng = np.random.RandomState(seed)
    documents = np.arange(len(sizes), dtype=np.int64 if wide else np.int32)
    doc_idx = np.concatenate([rng.permutation(documents) for _ in range(num_epochs)])
    epoch_tokens = int(sizes.sum())
    if (num_epochs * epoch_tokens - 1) // seq_length < 1:
        return
    compiled = helpers.build_sample_idx(sizes, doc_idx, seq_length, num_epochs, epoch_tokens)
    reference = build_sample_idx_numpy(sizes, doc_idx, seq_length, num_epochs, epoch_tokens)
    assert compiled.dtype == reference.dtype == np.int64
    np.testing.assert_array_equal(compiled, reference)


@settings(max_examples=60, deadline=None)
@given(
    weights=st.lists(st.floats(0.001, 100), min_size=1, max_size=12),
    num_samples=st.integers(0, 3000),
)
def test_blending_indices_identical(helpers, weights, num_samples):
    normalized = np.asarray(weights) / np.sum(weights)
    compiled = helpers.build_blending_indices(normalized, num_samples)
    reference = build_blending_indices_numpy(normalized, num_samples)
    for got, expected in zip(compiled, reference):
        assert got.dtype == expected.dtype
        np.testing.assert_array_equal(got, expected)


def test_blending_indices_identical_for_many_datasets_and_ties(helpers):
    for weights in (np.full(300, 1 / 300), np.array([0.25, 0.25, 0.5]), np.random.default_rng(1).random(1000) + 0.1):
        weights = weights / weights.sum()
        compiled = helpers.build_blending_indices(weights, 20_000)
        for got, expected in zip(compiled, build_blending_indices_numpy(weights, 20_000)):
            np.testing.assert_array_equal(got, expected)


def test_compiled_builders_reject_bad_input(helpers):
    sizes = np.array([3, 4], dtype=np.int32)
    with pytest.raises(ValueError, match="doc_idx entry 5 is outside sizes"):
        helpers.build_sample_idx(sizes, np.array([0, 5], dtype=np.int32), 2, 1, 7)
    with pytest.raises(ValueError, match="fewer tokens"):
        helpers.build_sample_idx(sizes, np.array([0], dtype=np.int32), 2, 1, 7)
    with pytest.raises(ValueError, match="positive"):
        helpers.build_blending_indices(np.array([1.0, 0.0]), 5)


def test_falls_back_to_numpy_when_no_compiler_works(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TOKENFORMER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")
    compiled_helpers.load_helpers.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="megatron.data.compiled_helpers"):
            assert compiled_helpers.load_helpers() is None
        assert "using the slower NumPy builders" in caplog.text and "compiling" in caplog.text
    finally:
        compiled_helpers.load_helpers.cache_clear()
