"""Checks of a dataset before a launch: truncated or foreign files, empty data, token ids past the
vocabulary, and the cached largest token id they rely on."""

import json
import os
import re
import struct

import numpy as np
import pytest

from megatron.config import load_config
from megatron.data.data_utils import build_datasets_from_paths, build_train_valid_test_datasets
from megatron.data.dataset_check import dataset_problems, stats_file_path
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
from megatron.data.token_ids import TokenIdError
from megatron.training.data import batch_iterator, build_datasets

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REBUILD = "re-run tools/preprocess_data.py"


def write_dataset(prefix, documents, dtype=np.uint16):
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype)
    for tokens in documents:
        builder.add_item(np.asarray(tokens))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


@pytest.fixture
def prefix(tmp_path):
    """Three documents whose largest token id is 500."""
    return write_dataset(str(tmp_path / "x_text_document"), [[1, 2, 3], [500, 7], [9]])


def rewrite(path, change):
    with open(path, "rb") as stream:
        content = bytearray(stream.read())
    with open(path, "wb") as stream:
        stream.write(change(content))


def test_a_good_dataset_has_no_problems(prefix):
    assert dataset_problems("data_path", prefix, 512) == []
    assert dataset_problems("data_path", prefix, None) == []


def test_missing_files_are_named(prefix):
    os.remove(prefix + ".idx")
    [problem] = dataset_problems("train_data_paths[0]", prefix, 512)
    assert problem.startswith(f"train_data_paths[0] = {prefix!r}: missing {prefix}.idx")


@pytest.mark.parametrize(
    "suffix, change, message",
    [
        (".bin", lambda b: b[:-2], r"\.bin is 10 bytes but .*\.idx describes 12 bytes .*truncated or mismatched"),
        (".bin", lambda b: b + b"\0\0", r"\.bin is 14 bytes but .*\.idx describes 12 bytes"),
        (".idx", lambda b: b"NOTANIDX\x00" + b[9:], r"\.idx: magic b'NOTANIDX\\x00' is not .*not a Megatron mmap"),
        (".idx", lambda b: b[:17] + struct.pack("<B", 42) + b[18:], r"\.idx: unknown dtype code 42"),
        (".idx", lambda b: b[:-8], r"\.idx: \d+ bytes, but its header .* truncated or corrupt"),
        (".idx", lambda b: b[:10], r"\.idx: 10 bytes is shorter than the 34-byte header"),
    ],
    ids=["bin-short", "bin-long", "magic", "dtype-code", "idx-truncated", "idx-header"],
)
def test_truncated_or_foreign_files_are_named_with_the_fix(prefix, suffix, change, message):
    rewrite(prefix + suffix, change)
    [problem] = dataset_problems("data_path", prefix, 512)
    assert problem.startswith(f"data_path = {prefix!r}: {prefix}")
    assert REBUILD in problem
    assert re.search(message, problem), problem


def test_float_tokens_are_not_token_ids(tmp_path):
    prefix = write_dataset(str(tmp_path / "f"), [[0.5, 1.5]], np.float32)
    [problem] = dataset_problems("data_path", prefix, 512)
    assert "says its tokens are float32, not integer token ids" in problem and REBUILD in problem


def test_an_empty_dataset_is_refused_before_launch(tmp_path):
    prefix = write_dataset(str(tmp_path / "empty"), [])
    assert dataset_problems("data_path", prefix, 512) == [
        f"data_path = {prefix!r}: {prefix}.idx holds no documents; re-run tools/preprocess_data.py on inputs that "
        f"have text"
    ]


def test_an_empty_dataset_is_a_named_error_in_the_ranks_too(tmp_path):
    """The ranks' own path names the empty dataset too, rather than failing inside the split arithmetic."""
    prefix = write_dataset(str(tmp_path / "empty"), [])
    with pytest.raises(ValueError, match=f"{prefix}: the dataset holds no documents"):
        build_train_valid_test_datasets(prefix, "969,30,1", [10, 0, 0], 8, 1)
    with pytest.raises(ValueError, match=f"{prefix}: the dataset holds no documents"):
        build_datasets_from_paths([prefix], None, None, [10, 0, 0], 8, 1)
    cfg = load_config([os.path.join(REPO_ROOT, "tests/tiny.yml")], [f"data_path={prefix}"], world_size=2)
    with pytest.raises(ValueError, match="holds no documents"):
        build_datasets(cfg)


def test_a_split_that_gives_train_nothing_is_a_named_error(prefix):
    cfg = load_config([os.path.join(REPO_ROOT, "tests/tiny.yml")], [f"data_path={prefix}", "split='0,1,0'"],
                      world_size=2)
    with pytest.raises(ValueError, match=r"split = '0,1,0' leaves the train split no documents"):
        build_datasets(cfg)


def test_token_ids_past_the_padded_vocabulary_are_named(prefix):
    assert dataset_problems("data_path", prefix, 501) == []
    assert dataset_problems("data_path", prefix, 500) == [
        f"data_path = {prefix!r}: {prefix}.bin holds token ids up to 500 but the padded vocabulary has 500 rows; "
        f"use the tokenizer the data was made with (vocab_file), or re-run tools/preprocess_data.py with this one"
    ]


def test_ids_past_the_vocabulary_that_a_stale_stats_cache_passes_are_refused_by_each_batch(tmp_path):
    """An edit in place that keeps the .bin's size and mtime (or bit rot) leaves PREFIX.stats.json valid: the launch
    check passed its old largest id, and the ranks embedded id 300 of a 128-row vocabulary as zeros and skipped
    every step naming no cause. Each batch is checked on the host: the file, the document and the id are named."""
    documents = [[1 + (3 * d + t) % 90 for t in range(10)] for d in range(12)]
    prefix = write_dataset(str(tmp_path / "edited_text_document"), documents)
    other = write_dataset(str(tmp_path / "other_text_document"), documents)
    assert dataset_problems("data_path", prefix, 128) == []  # scanned and cached
    status = os.stat(prefix + ".bin")
    rewrite(prefix + ".bin", lambda content: content[:2 * (7 * 10 + 2)] + struct.pack("<H", 300)
            + content[2 * (7 * 10 + 3):])  # document 7's third token
    os.utime(prefix + ".bin", ns=(status.st_atime_ns, status.st_mtime_ns))
    assert dataset_problems("data_path", prefix, 128) == []  # the stale cache passes it
    expected = (f"{prefix}.bin: document 7 holds token id 300, outside the padded vocabulary of 128 rows; the file "
                f"changed since {prefix}.stats.json was written (it keeps its size and time), or was made with "
                "another tokenizer: rebuild it with tools/preprocess_data.py and this run's tokenizer (vocab_file)")
    alone = build_train_valid_test_datasets(prefix, "1,0,0", [12, 0, 0], 8, 1)[0]
    blend = build_datasets_from_paths([other, prefix], None, None, [24, 0, 0], 8, 1, ([1, 1], None, None))[0]
    for dataset in (alone, blend):
        assert len(list(batch_iterator(dataset, 0, 2, 0, 1))) == len(dataset) // 2  # unchecked: read as they are
        with pytest.raises(TokenIdError) as refused:
            list(batch_iterator(dataset, 0, 2, 0, 1, vocab_size=128))
        assert str(refused.value) == expected
    assert sum(batch.numel() for batch in batch_iterator(alone, 0, 2, 0, 1, vocab_size=301)) == len(alone) * 9


def read_stats(prefix):
    with open(stats_file_path(prefix)) as stream:
        return json.load(stream)


def write_stats(prefix, entry):
    with open(stats_file_path(prefix), "w") as stream:
        json.dump(entry, stream)


def test_the_largest_id_is_scanned_once_and_cached_by_size_and_mtime(prefix):
    assert not os.path.exists(stats_file_path(prefix))
    dataset_problems("data_path", prefix, 512)
    status = os.stat(prefix + ".bin")
    assert read_stats(prefix) == {"bin_bytes": status.st_size, "bin_mtime_ns": status.st_mtime_ns, "max_token_id": 500}
    # The cached value is what the check uses: a planted one for this very .bin is believed...
    write_stats(prefix, {**read_stats(prefix), "max_token_id": 70_000})
    assert "token ids up to 70000" in dataset_problems("data_path", prefix, 512)[0]
    # ...until the .bin's mtime no longer matches the entry: then it is scanned again and the entry rewritten.
    os.utime(prefix + ".bin", ns=(status.st_atime_ns, status.st_mtime_ns + 1_000_000_000))
    assert dataset_problems("data_path", prefix, 512) == []
    assert read_stats(prefix)["max_token_id"] == 500
    assert read_stats(prefix)["bin_mtime_ns"] == status.st_mtime_ns + 1_000_000_000


def test_an_entry_for_another_size_or_an_unreadable_one_is_recomputed(prefix):
    status = os.stat(prefix + ".bin")
    write_stats(prefix, {"bin_bytes": status.st_size + 2, "bin_mtime_ns": status.st_mtime_ns, "max_token_id": 9999})
    assert dataset_problems("data_path", prefix, 512) == []
    assert read_stats(prefix)["max_token_id"] == 500
    with open(stats_file_path(prefix), "w") as stream:
        stream.write('{"bin_bytes": ')
    assert dataset_problems("data_path", prefix, 512) == []
    assert read_stats(prefix)["max_token_id"] == 500


def test_the_scan_reads_every_chunk(tmp_path):
    """A .bin longer than one scan chunk (16M tokens) with its largest id in the last chunk."""
    prefix = write_dataset(str(tmp_path / "long"), [np.zeros((1 << 24) + 5, dtype=np.uint16), [3, 60_000], [5]])
    assert "token ids up to 60000" in dataset_problems("data_path", prefix, 50_000)[0]
    assert read_stats(prefix)["max_token_id"] == 60_000
