"""The mmap indexed format: round trips, the exact byte layout, and clear errors for bad files."""

import os
import pickle
import struct

import numpy as np
import pytest
import torch

from megatron.data.indexed_dataset import (
    DTYPE_CODES,
    IndexedDatasetError,
    MMapIndexedDataset,
    MMapIndexedDatasetBuilder,
    best_fitting_dtype,
)


def write_dataset(prefix, documents, dtype):
    """documents: list of documents, each a list of sequences (lists of tokens)."""
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype)
    for document in documents:
        for sequence in document:
            builder.add_item(np.asarray(sequence))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def random_documents(rng, dtype, count=7):
    info = np.iinfo(dtype) if np.issubdtype(dtype, np.integer) else None
    documents = []
    for _ in range(count):
        sequences = []
        for _ in range(rng.integers(1, 4)):
            length = int(rng.integers(0, 20))
            if info is None:
                sequences.append(rng.normal(size=length).astype(dtype))
            else:
                sequences.append(rng.integers(info.min, info.max, size=length, endpoint=True, dtype=dtype))
        documents.append(sequences)
    return documents


@pytest.mark.parametrize("dtype", list(DTYPE_CODES.values()), ids=lambda d: np.dtype(d).name)
def test_round_trip_every_dtype(tmp_path, dtype):
    documents = random_documents(np.random.default_rng(0), dtype)
    dataset = MMapIndexedDataset(write_dataset(str(tmp_path / "data"), documents, dtype))
    sequences = [sequence for document in documents for sequence in document]
    assert len(dataset) == len(sequences)
    assert dataset.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(dataset.sizes, [len(s) for s in sequences])
    np.testing.assert_array_equal(dataset.doc_idx, np.cumsum([0] + [len(d) for d in documents]))
    for index, sequence in enumerate(sequences):
        np.testing.assert_array_equal(dataset[index], sequence)
        assert dataset[index].dtype == np.dtype(dtype)
    for got, expected in zip(dataset[2:5], sequences[2:5]):
        np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(dataset[-1], sequences[-1])


def test_get_reads_part_of_a_sequence(tmp_path):
    dataset = MMapIndexedDataset(write_dataset(str(tmp_path / "d"), [[[5, 6, 7, 8, 9]], [[1, 2]]], np.uint16))
    np.testing.assert_array_equal(dataset.get(0, offset=1, length=3), [6, 7, 8])
    np.testing.assert_array_equal(dataset.get(0, offset=3), [8, 9])
    np.testing.assert_array_equal(dataset.get(1), [1, 2])
    with pytest.raises(IndexError, match="size 5"):
        dataset.get(0, offset=4, length=2)
    with pytest.raises(IndexError, match="2 sequences"):
        dataset.get(2)
    with pytest.raises(ValueError, match="contiguous"):
        dataset[0:2:2]


def test_builder_accepts_torch_tensors_and_rejects_bad_tokens(tmp_path):
    prefix = str(tmp_path / "t")
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", np.uint16)
    builder.add_item(torch.tensor([1, 2, 65535]))
    with pytest.raises(ValueError, match="65536 does not fit uint16"):
        builder.add_item(np.array([65536]))
    with pytest.raises(ValueError, match="-1 does not fit uint16"):
        builder.add_item(np.array([-1, 3]))
    with pytest.raises(ValueError, match="1-D"):
        builder.add_item(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="integers"):
        builder.add_item(np.array([1.5]))
    builder.end_document()
    builder.finalize(prefix + ".idx")
    np.testing.assert_array_equal(MMapIndexedDataset(prefix)[0], [1, 2, 65535])
    with pytest.raises(ValueError, match="cannot be stored"):
        MMapIndexedDatasetBuilder(str(tmp_path / "u.bin"), np.uint32)


def test_idx_byte_layout_matches_the_format_description(tmp_path):
    # Format (GPT-NeoX / Megatron mmap index), little-endian: 9-byte magic "MMIDIDX\0\0", uint64 version 1,
    # uint8 dtype code (8 = uint16), uint64 n sequences, uint64 m doc_idx entries,
    # int32 sizes[n], int64 byte pointers[n], int64 doc_idx[m].
    prefix = write_dataset(str(tmp_path / "layout"), [[[10, 11, 12], [13]], [[14, 15]]], np.uint16)
    expected = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8) + struct.pack("<QQ", 3, 3)
    expected += struct.pack("<3i", 3, 1, 2) + struct.pack("<3q", 0, 6, 8) + struct.pack("<3q", 0, 2, 3)
    with open(prefix + ".idx", "rb") as stream:
        assert stream.read() == expected
    with open(prefix + ".bin", "rb") as stream:
        assert stream.read() == struct.pack("<6H", 10, 11, 12, 13, 14, 15)


# The dtype codes of Megatron-core's DType enum (GPT-NeoX's table agrees on every code it writes).
FORMAT_DTYPE_CODES = {
    1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 6: "<f8", 7: "<f4", 8: "<u2",
}


def index_bytes(code, sizes, doc_idx):
    """An .idx built from the format description alone, as another Megatron/GPT-NeoX writer produces it."""
    itemsize = np.dtype(FORMAT_DTYPE_CODES[code]).itemsize
    pointers = np.concatenate([[0], np.cumsum(sizes)[:-1]]) * itemsize
    header = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, len(sizes), len(doc_idx))
    return (
        header + np.asarray(sizes, "<i4").tobytes() + np.asarray(pointers, "<i8").tobytes()
        + np.asarray(doc_idx, "<i8").tobytes()
    )


@pytest.mark.parametrize("code", sorted(FORMAT_DTYPE_CODES))
def test_files_of_other_writers_read_and_ours_match_them_byte_for_byte(tmp_path, code):
    dtype = np.dtype(FORMAT_DTYPE_CODES[code])
    sequences = [np.arange(3, dtype=dtype), np.array([], dtype=dtype), np.arange(5, 10).astype(dtype)]
    sizes, doc_idx = [3, 0, 5], [0, 2, 3]
    foreign = tmp_path / "foreign"
    (tmp_path / "foreign.idx").write_bytes(index_bytes(code, sizes, doc_idx))
    (tmp_path / "foreign.bin").write_bytes(b"".join(s.tobytes() for s in sequences))
    dataset = MMapIndexedDataset(str(foreign))
    assert dataset.dtype == dtype
    assert [dataset[i].tolist() for i in range(3)] == [s.tolist() for s in sequences]
    np.testing.assert_array_equal(dataset.doc_idx, doc_idx)
    write_dataset(str(tmp_path / "ours"), [sequences[:2], sequences[2:]], dtype)
    assert (tmp_path / "ours.idx").read_bytes() == (tmp_path / "foreign.idx").read_bytes()
    assert (tmp_path / "ours.bin").read_bytes() == (tmp_path / "foreign.bin").read_bytes()
    assert np.dtype(DTYPE_CODES[code]) == dtype


def test_best_fitting_dtype():
    assert best_fitting_dtype(50277) == np.uint16
    assert best_fitting_dtype(65499) == np.uint16
    assert best_fitting_dtype(65500) == np.int32
    assert best_fitting_dtype(256000) == np.int32


def test_empty_dataset_round_trips(tmp_path):
    prefix = str(tmp_path / "empty")
    MMapIndexedDatasetBuilder(prefix + ".bin", np.int32).finalize(prefix + ".idx")
    dataset = MMapIndexedDataset(prefix)
    assert len(dataset) == 0
    np.testing.assert_array_equal(dataset.doc_idx, [0])


def test_pickles_by_prefix(tmp_path):
    prefix = write_dataset(str(tmp_path / "p"), [[[1, 2, 3]]], np.int32)
    clone = pickle.loads(pickle.dumps(MMapIndexedDataset(prefix)))
    np.testing.assert_array_equal(clone[0], [1, 2, 3])


@pytest.fixture
def good_prefix(tmp_path):
    return write_dataset(str(tmp_path / "good"), [[[1, 2, 3]], [[4, 5]]], np.uint16)


def rewrite(path, change):
    with open(path, "rb") as stream:
        content = bytearray(stream.read())
    with open(path, "wb") as stream:
        stream.write(change(content))


@pytest.mark.parametrize(
    "suffix, change, message",
    [
        (".idx", lambda b: b"NOTANIDX\x00" + b[9:], "magic"),
        (".idx", lambda b: b[:9] + struct.pack("<Q", 2) + b[17:], "version 2"),
        (".idx", lambda b: b[:17] + struct.pack("<B", 42) + b[18:], "dtype code 42"),
        (".idx", lambda b: b[:-8], "truncated or corrupt"),
        (".idx", lambda b: b[:20], "shorter than"),
        (".idx", lambda b: b[:34] + struct.pack("<i", 4) + b[38:], "truncated or mismatched"),
        (".idx", lambda b: b[:42] + struct.pack("<q", 2) + b[50:], "pointer of sequence 0 is 2"),
        (".idx", lambda b: b[:50] + struct.pack("<q", 4) + b[58:], "pointer of sequence 1 is 4, .* at byte 6"),
        (".idx", lambda b: b[:34] + struct.pack("<ii", -1, 6) + b[42:], "negative size at sequence 0"),
        (".idx", lambda b: b[:58] + struct.pack("<q", 1) + b[66:], r"doc_idx\[0\] = 1"),
        (".idx", lambda b: b[:66] + struct.pack("<q", 3) + b[74:], r"doc_idx\[1\] = 3; .* sequence count 2"),
        (".idx", lambda b: b[:66] + struct.pack("<qq", 2, 1), r"doc_idx\[2\] = 1"),
        (".bin", lambda b: b[:-2], "truncated or mismatched"),
        (".bin", lambda b: b + b"\x00\x00", "truncated or mismatched"),
    ],
    ids=[
        "magic", "version", "dtype", "idx-truncated", "idx-header", "sizes", "first-pointer", "later-pointer",
        "negative-size", "doc-idx-start", "doc-idx-past-end", "doc-idx-decreasing", "bin-short", "bin-long",
    ],
)
def test_corrupt_files_are_rejected_naming_the_file(good_prefix, suffix, change, message):
    rewrite(good_prefix + suffix, change)
    with pytest.raises(IndexedDatasetError, match=message) as error:
        MMapIndexedDataset(good_prefix)
    assert os.path.basename(good_prefix) in str(error.value)


def test_mismatched_pair_is_rejected(tmp_path, good_prefix):
    other = write_dataset(str(tmp_path / "other"), [[[1, 2, 3, 4, 5, 6, 7]]], np.uint16)
    os.replace(other + ".bin", good_prefix + ".bin")
    with pytest.raises(IndexedDatasetError, match="good.bin is 14 bytes but .*good.idx describes 10 bytes"):
        MMapIndexedDataset(good_prefix)


@pytest.mark.parametrize("suffix", [".bin", ".idx"])
def test_missing_file_is_named(good_prefix, suffix):
    os.remove(good_prefix + suffix)
    with pytest.raises(FileNotFoundError, match=f"good\\{suffix} not found: the data prefix"):
        MMapIndexedDataset(good_prefix)
