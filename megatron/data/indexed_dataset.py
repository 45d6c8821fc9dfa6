"""Megatron / GPT-NeoX memory-mapped indexed dataset: ``PREFIX.bin`` + ``PREFIX.idx``.

Kept byte-compatible with GPT-NeoX and Megatron-LM so corpora tokenised by
either tool load here unchanged. ``PREFIX.bin`` holds the token sequences back
to back and nothing else. ``PREFIX.idx`` is, all little-endian:

    9 bytes    magic b"MMIDIDX\\x00\\x00"
    uint64     version, always 1
    uint8      dtype code of the tokens in .bin (``DTYPE_CODES``)
    uint64     n, the number of sequences
    uint64     m, the number of doc_idx entries
    int32[n]   sizes: tokens in each sequence
    int64[n]   pointers: byte offset of each sequence in .bin
    int64[m]   doc_idx: 0, then the sequence count after each finished document

Both files are memory-mapped, so opening a Pile-sized dataset costs no RAM.
"""

import array
import os
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from megatron.cli import InputError

if TYPE_CHECKING:  # torch is not imported at run time: the preprocessing tools start faster without it
    pass

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
# Megatron-core's DType enum. GPT-NeoX's table agrees except that it also reads 7 as float64
# (it maps both 6 and 7 to a 64-bit float); token data never uses either code.
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
# Entries checked per step when validating an index, so opening a Pile-sized one stays in bounded memory.
_CHECK_CHUNK = 1 << 22
_HEADER = struct.Struct("<9sQBQQ")
_LITTLE_INT32 = np.dtype("<i4")
_LITTLE_INT64 = np.dtype("<i8")

TokenArray = "np.ndarray | torch.Tensor"
REBUILD_HINT = "re-run tools/preprocess_data.py to rebuild the .bin/.idx pair"


class IndexedDatasetError(InputError):
    """A ``.bin``/``.idx`` pair that is corrupt, truncated or mismatched."""


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def prefix_hint(prefix: str) -> str:
    """What a data prefix is, for one that names no dataset, with the prefix meant where `prefix` is a dataset's
    .bin or .idx file or the directory holding datasets."""
    rule = ("the data prefix is the path without .bin/.idx (e.g. data/demo/demo_text_document), produced by "
            "tools/preprocess_data.py")
    stem, suffix = os.path.splitext(prefix)
    if suffix in (".bin", ".idx") and os.path.isfile(data_file_path(stem)) and os.path.isfile(index_file_path(stem)):
        return f"{rule}; for {prefix} that is {stem}"
    found = sorted(name[:-4] for name in (os.listdir(prefix) if os.path.isdir(prefix) else ())
                   if name.endswith(".idx") and os.path.isfile(os.path.join(prefix, name[:-4] + ".bin")))
    if found:
        meant = ", ".join(os.path.join(prefix, name) for name in found[:3]) + (", ..." if len(found) > 3 else "")
        return f"{rule}; {prefix} is a directory, holding the dataset{'s' if len(found) > 1 else ''} {meant}"
    return rule


def best_fitting_dtype(vocab_size: int) -> type:
    """Smallest token dtype GPT-NeoX uses for a vocabulary: halves the .bin for vocabs < 65500."""
    if vocab_size <= 0:
        raise InputError(f"vocab_size must be positive, got {vocab_size}")
    return np.uint16 if vocab_size < 65500 else np.int32


def dtype_code(dtype) -> int:
    """The .idx code of ``dtype``; error if the format cannot store it."""
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == np.dtype(dtype):
            return code
    supported = ", ".join(np.dtype(d).name for d in DTYPE_CODES.values())
    raise ValueError(f"dtype {np.dtype(dtype).name} cannot be stored in an indexed dataset; use one of: {supported}")


@dataclass(frozen=True)
class IndexHeader:
    """What an ``.idx`` header says; ``read_index_header`` has checked it against the file's length."""

    dtype: np.dtype
    num_sequences: int
    num_doc_idx: int


def read_index_header(idx_path: str) -> IndexHeader:
    """The header of ``idx_path``, read without mapping the arrays: cheap enough for checks before a launch.

    Raises IndexedDatasetError naming the file and the fix when it is not an
    index, its version or dtype code is unknown, or its length disagrees.
    """
    idx_bytes = os.path.getsize(idx_path)
    if idx_bytes < _HEADER.size:
        raise IndexedDatasetError(
            f"{idx_path}: {idx_bytes} bytes is shorter than the {_HEADER.size}-byte header; {REBUILD_HINT}"
        )
    with open(idx_path, "rb") as stream:
        magic, version, code, num_sequences, num_doc_idx = _HEADER.unpack(stream.read(_HEADER.size))
    if magic != INDEX_MAGIC:
        raise IndexedDatasetError(
            f"{idx_path}: magic {magic!r} is not {INDEX_MAGIC!r}, so this is not a Megatron mmap index; {REBUILD_HINT}"
        )
    if version != INDEX_VERSION:
        raise IndexedDatasetError(
            f"{idx_path}: index version {version} is not the supported {INDEX_VERSION}; {REBUILD_HINT}"
        )
    if code not in DTYPE_CODES:
        raise IndexedDatasetError(
            f"{idx_path}: unknown dtype code {code} (known codes are {sorted(DTYPE_CODES)}); {REBUILD_HINT}"
        )
    expected_idx_bytes = _HEADER.size + num_sequences * (4 + 8) + num_doc_idx * 8
    if idx_bytes != expected_idx_bytes:
        raise IndexedDatasetError(
            f"{idx_path}: {idx_bytes} bytes, but its header ({num_sequences} sequences, {num_doc_idx} doc_idx "
            f"entries) needs {expected_idx_bytes}; the index is truncated or corrupt; {REBUILD_HINT}"
        )
    return IndexHeader(np.dtype(DTYPE_CODES[code]), num_sequences, num_doc_idx)


def sequence_sizes(idx_path: str, header: IndexHeader) -> np.ndarray:
    """Every sequence's token count, memory-mapped (the header read by read_index_header)."""
    return _memmap(idx_path, _LITTLE_INT32, _HEADER.size, header.num_sequences)


def described_data_bytes(idx_path: str, header: IndexHeader) -> int:
    """Length of the ``.bin`` the index describes: where its last sequence ends (two entries read, not all).

    Opening the dataset checks every pointer against the sizes; this is the
    cheap version for checks before a launch.
    """
    if header.num_sequences == 0:
        return 0
    last = header.num_sequences - 1
    with open(idx_path, "rb") as stream:
        stream.seek(_HEADER.size + last * 4)
        (size,) = struct.unpack("<i", stream.read(4))
        stream.seek(_HEADER.size + header.num_sequences * 4 + last * 8)
        (pointer,) = struct.unpack("<q", stream.read(8))
    return pointer + size * header.dtype.itemsize


def _little_endian(dtype) -> np.dtype:
    return np.dtype(dtype).newbyteorder("<")


def _memmap(path: str, dtype: np.dtype, offset: int = 0, count: int = -1) -> np.ndarray:
    """Read-only view of ``count`` items at ``offset``; numpy cannot map zero bytes, hence the plain empty array."""
    if count == 0 or os.path.getsize(path) == offset:
        return np.empty(0, dtype=dtype)
    shape = None if count < 0 else (count,)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)


class MMapIndexedDataset:
    """Random access to the token sequences of ``PREFIX.bin`` through ``PREFIX.idx``."""

    def __init__(self, prefix: str):
        self._open(prefix)

    def _open(self, prefix: str) -> None:
        self.prefix = prefix
        idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"indexed dataset file {path} not found: {prefix_hint(prefix)}")
        header = read_index_header(idx_path)
        num_sequences = header.num_sequences
        self._dtype = header.dtype
        self._sizes = _memmap(idx_path, _LITTLE_INT32, _HEADER.size, num_sequences)
        self._pointers = _memmap(idx_path, _LITTLE_INT64, _HEADER.size + num_sequences * 4, num_sequences)
        self._doc_idx = _memmap(idx_path, _LITTLE_INT64, _HEADER.size + num_sequences * 12, header.num_doc_idx)
        self._check_data_file(idx_path, bin_path)
        self._tokens = _memmap(bin_path, _little_endian(self._dtype))

    def _check_data_file(self, idx_path: str, bin_path: str) -> None:
        bin_bytes = os.path.getsize(bin_path)
        expected_bin_bytes = int(np.sum(self._sizes, dtype=np.int64)) * self._dtype.itemsize
        if bin_bytes != expected_bin_bytes:
            raise IndexedDatasetError(
                f"{bin_path} is {bin_bytes} bytes but {idx_path} describes {expected_bin_bytes} bytes "
                f"({len(self._sizes)} sequences of {self._dtype.name}); the pair is truncated or mismatched; "
                f"{REBUILD_HINT}"
            )
        self._check_pointers(idx_path)
        self._check_doc_idx(idx_path)

    def _check_pointers(self, idx_path: str) -> None:
        """Each sequence must start right where the one before it ends: pointers are the running sum of sizes."""
        itemsize = self._dtype.itemsize
        next_pointer = 0
        for start in range(0, len(self._sizes), _CHECK_CHUNK):
            sizes = self._sizes[start : start + _CHECK_CHUNK].astype(np.int64)
            if sizes.min() < 0:
                raise IndexedDatasetError(f"{idx_path}: negative size at sequence {start + int(np.argmin(sizes))}")
            ends = np.cumsum(sizes * itemsize) + next_pointer
            expected = ends - sizes * itemsize
            next_pointer = int(ends[-1])
            wrong = np.flatnonzero(self._pointers[start : start + _CHECK_CHUNK] != expected)
            if wrong.size:
                index = start + int(wrong[0])
                raise IndexedDatasetError(
                    f"{idx_path}: pointer of sequence {index} is {int(self._pointers[index])}, but the sizes before "
                    f"it put it at byte {int(expected[wrong[0]])}; the sequence pointers are corrupt"
                )

    def _check_doc_idx(self, idx_path: str) -> None:
        """doc_idx must start at 0, never decrease, and never pass the sequence count."""
        previous = 0
        for start in range(0, len(self._doc_idx), _CHECK_CHUNK):
            chunk = self._doc_idx[start : start + _CHECK_CHUNK]
            bad = np.flatnonzero((np.diff(chunk, prepend=previous) < 0) | (chunk > len(self._sizes)))
            if start == 0 and chunk[0] != 0:
                bad = np.array([0])
            if bad.size:
                index = start + int(bad[0])
                raise IndexedDatasetError(
                    f"{idx_path}: doc_idx[{index}] = {int(self._doc_idx[index])}; doc_idx must start at 0 and rise "
                    f"to at most the sequence count {len(self._sizes)}, so the index is corrupt"
                )
            previous = int(chunk[-1])

    def __getstate__(self) -> str:
        return self.prefix

    def __setstate__(self, prefix: str) -> None:
        self._open(prefix)

    def __len__(self) -> int:
        return len(self._sizes)

    def __getitem__(self, idx: int | slice):
        """One sequence as an array, or a contiguous slice as a list of arrays."""
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(f"slices of {self.prefix} must be contiguous (step 1), got step {step}")
            return [self.get(i) for i in range(start, stop)]
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset .. offset+length`` of sequence ``idx`` (to its end when length is None)."""
        count = len(self)
        if not -count <= idx < count:
            raise IndexError(f"sequence {idx} out of range for {self.prefix} with {count} sequences")
        idx = int(idx) % count
        size = int(self._sizes[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) out of range for sequence {idx} of size {size}")
        start = int(self._pointers[idx]) // self._dtype.itemsize + offset
        return np.asarray(self._tokens[start : start + length])

    @property
    def sizes(self) -> np.ndarray:
        return self._sizes

    @property
    def doc_idx(self) -> np.ndarray:
        return self._doc_idx

    @property
    def dtype(self) -> np.dtype:
        return self._dtype


class MMapIndexedDatasetBuilder:
    """Streams sequences into a ``.bin`` and writes the matching ``.idx`` on ``finalize``.

    Sizes are kept in compact C arrays (4 bytes a sequence), so building a
    Pile-scale dataset stays within memory.
    """

    def __init__(self, bin_path: str, dtype=np.int32):
        dtype_code(dtype)
        self._dtype = np.dtype(dtype)
        self._bin_path = bin_path
        self._data_file = open(bin_path, "wb")
        self._sizes = array.array("i")
        self._doc_idx = array.array("q", [0])

    def add_item(self, tokens: TokenArray) -> None:
        """Append one 1-D sequence of tokens."""
        if hasattr(tokens, "detach"):  # a torch.Tensor
            tokens = tokens.detach().cpu().numpy()
        values = self._checked(np.asarray(tokens))
        if values.size > np.iinfo(np.int32).max:
            raise ValueError(f"{self._bin_path}: a sequence of {values.size} tokens exceeds the format's int32 size")
        self._data_file.write(values.astype(_little_endian(self._dtype), copy=False).tobytes())
        self._sizes.append(values.size)

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents of one sequence each, given back to back: the same bytes as add_item + end_document."""
        values = self._checked(np.asarray(tokens))
        lengths = np.asarray(lengths, dtype=np.int64)
        fits = not lengths.size or (lengths.min() >= 0 and lengths.max() <= np.iinfo(np.int32).max)
        if not fits or lengths.sum() != values.size:
            raise ValueError(f"{self._bin_path}: document lengths must be int32 sizes summing to {values.size} tokens")
        self._data_file.write(values.astype(_little_endian(self._dtype), copy=False).tobytes())
        first_document = len(self._sizes)
        self._sizes.frombytes(lengths.astype(np.intc).tobytes())
        self._doc_idx.frombytes(np.arange(first_document + 1, len(self._sizes) + 1, dtype=np.longlong).tobytes())

    def _checked(self, values: np.ndarray) -> np.ndarray:
        """``values`` if they are 1-D and fit the dataset's dtype; an error naming the offender otherwise."""
        if values.ndim != 1:
            raise ValueError(f"{self._bin_path}: add_item takes a 1-D token sequence, got shape {values.shape}")
        if np.issubdtype(self._dtype, np.integer) and values.size:
            if not np.issubdtype(values.dtype, np.integer):
                raise ValueError(f"{self._bin_path}: tokens must be integers, got {values.dtype.name}")
            limits = np.iinfo(self._dtype)
            low, high = int(values.min()), int(values.max())
            if low < limits.min or high > limits.max:
                raise ValueError(
                    f"{self._bin_path}: token {low if low < limits.min else high} does not fit {self._dtype.name}; "
                    f"build with a wider dtype (best_fitting_dtype(vocab_size))"
                )
        return values

    def end_document(self) -> None:
        """Mark the sequences added since the last call as one document."""
        self._doc_idx.append(len(self._sizes))

    def finalize(self, idx_path: str) -> None:
        """Close the ``.bin`` and write the ``.idx`` describing it."""
        self._data_file.close()
        sizes = np.frombuffer(self._sizes, dtype=np.intc).astype(_LITTLE_INT32)
        pointers = np.zeros(len(sizes), dtype=_LITTLE_INT64)
        np.cumsum(sizes[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self._dtype.itemsize
        doc_idx = np.frombuffer(self._doc_idx, dtype=np.longlong).astype(_LITTLE_INT64)
        with open(idx_path, "wb") as stream:
            stream.write(_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, dtype_code(self._dtype), len(sizes), len(doc_idx)))
            stream.write(sizes.tobytes())
            stream.write(pointers.tobytes())
            stream.write(doc_idx.tobytes())
