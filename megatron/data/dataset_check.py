"""Checks of a dataset before a launch: the problems that would otherwise crash, or silently spoil, a run.

Everything is found from file sizes, the ``.idx`` header and the largest
token id of the ``.bin``, so checking a Pile-sized dataset reads no token
data once that id is known. tools/preprocess_data.py knows it and
writes it to ``PREFIX.stats.json`` beside the data when it publishes the
dataset; for a dataset made by other tools the ``.bin`` is scanned once in
bounded chunks and the result cached in that same file. Like the index
caches (``index_cache``) it lives beside the data, is written under a unique
name and renamed, and is built under a ``.lock`` so concurrent ranks and jobs
scan once. An entry counts only while the ``.bin`` has the size and mtime it
records (its path is where the entry sits); otherwise it is computed again,
e.g. once after a copy that does not keep mtimes.
"""

import fcntl
import json
import os
import socket
import uuid

import numpy as np

from megatron.data.indexed_dataset import (
    REBUILD_HINT,
    IndexedDatasetError,
    IndexHeader,
    data_file_path,
    described_data_bytes,
    index_file_path,
    read_index_header,
)

STATS_SUFFIX = ".stats.json"
_SCAN_CHUNK = 1 << 24  # tokens per read when scanning a .bin: 16M tokens, at most 128 MiB


def dataset_problems(key: str, prefix: str, padded_vocab_size: int | None) -> list[str]:
    """Every problem of the dataset PREFIX.bin/PREFIX.idx that config key `key` names (e.g. "data_path" or
    "train_data_paths[0]"), found from file sizes, headers and the cached largest token id; [] if it is fine.
    padded_vocab_size None skips the token-id check."""
    named = f"{key} = {prefix!r}"
    bin_path, idx_path = data_file_path(prefix), index_file_path(prefix)
    missing = [path for path in (bin_path, idx_path) if not os.path.isfile(path)]
    if missing:
        return [f"{named}: missing {', '.join(missing)}; give the PREFIX of PREFIX.bin/PREFIX.idx made by "
                f"tools/preprocess_data.py"]
    try:
        header = read_index_header(idx_path)
    except IndexedDatasetError as error:
        return [f"{named}: {error}"]
    if not np.issubdtype(header.dtype, np.integer):
        return [f"{named}: {idx_path} says its tokens are {header.dtype.name}, not integer token ids; {REBUILD_HINT}"]
    expected, actual = described_data_bytes(idx_path, header), os.path.getsize(bin_path)
    if actual != expected:
        return [f"{named}: {bin_path} is {actual} bytes but {idx_path} describes {expected} bytes "
                f"({header.num_sequences} sequences of {header.dtype.name}); the pair is truncated or mismatched; "
                f"{REBUILD_HINT}"]
    if header.num_sequences == 0 or actual == 0:
        held = "no documents" if header.num_sequences == 0 else f"{header.num_sequences} sequences but no tokens"
        return [f"{named}: {idx_path} holds {held}; re-run tools/preprocess_data.py on inputs that have text"]
    if padded_vocab_size is None:
        return []
    largest = largest_token_id(prefix, header)
    if largest is not None and largest >= padded_vocab_size:
        return [f"{named}: {bin_path} holds token ids up to {largest} but the padded vocabulary has "
                f"{padded_vocab_size} rows; use the tokenizer the data was made with (vocab_file), or re-run "
                f"tools/preprocess_data.py with this one"]
    return []


def stats_file_path(prefix: str) -> str:
    return prefix + STATS_SUFFIX


def record_largest_token_id(prefix: str, largest: int | None) -> None:
    """Write PREFIX.stats.json for the .bin as it is now: only for the tool that wrote it, which saw every token."""
    _save_atomically(stats_file_path(prefix), {**_bin_key(prefix), "max_token_id": largest})


def largest_token_id(prefix: str, header: IndexHeader) -> int | None:
    """The largest token id in PREFIX.bin (None when it holds no tokens): from PREFIX.stats.json when that was
    written for this .bin, otherwise scanned and cached there. A directory we cannot write is scanned uncached."""
    stats_path = stats_file_path(prefix)
    if (entry := _valid_entry(prefix)) is not None:
        return entry["max_token_id"]
    try:
        lock = open(stats_path + ".lock", "a")
    except OSError:
        return _scan(data_file_path(prefix), header)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (entry := _valid_entry(prefix)) is not None:  # another rank or job scanned while we waited
            return entry["max_token_id"]
        key = _bin_key(prefix)
        largest = _scan(data_file_path(prefix), header)
        try:
            _save_atomically(stats_path, {**key, "max_token_id": largest})
        except OSError:
            pass  # the value is right; the next check scans again
        return largest


def _bin_key(prefix: str) -> dict[str, int]:
    status = os.stat(data_file_path(prefix))
    return {"bin_bytes": status.st_size, "bin_mtime_ns": status.st_mtime_ns}


def _valid_entry(prefix: str) -> dict | None:
    """The stats entry if it describes the .bin as it is now; None if absent, unreadable or stale."""
    try:
        with open(stats_file_path(prefix), encoding="utf-8") as stream:
            entry = json.load(stream)
    except (OSError, ValueError):
        return None
    key = _bin_key(prefix)
    if not isinstance(entry, dict) or any(entry.get(name) != value for name, value in key.items()):
        return None
    largest = entry.get("max_token_id")
    return entry if "max_token_id" in entry and (largest is None or type(largest) is int) else None


def _scan(bin_path: str, header: IndexHeader) -> int | None:
    """Largest value of the .bin, read a chunk at a time so memory stays bounded on any size."""
    if os.path.getsize(bin_path) == 0:
        return None
    tokens = np.memmap(bin_path, dtype=header.dtype.newbyteorder("<"), mode="r")
    return max(int(tokens[start : start + _SCAN_CHUNK].max()) for start in range(0, len(tokens), _SCAN_CHUNK))


def _save_atomically(path: str, entry: dict) -> None:
    """Write under a name unique across hosts and processes, then rename: readers never see half a file."""
    temporary = f"{path}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(temporary, "w", encoding="utf-8") as stream:
            json.dump(entry, stream)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
