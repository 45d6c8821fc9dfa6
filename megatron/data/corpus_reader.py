"""Stream raw documents out of corpus files: ``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst`` and ``.txt``.

JSON-lines files give one record per line (parsed later, in the workers). A
``.txt`` file is one document (``txt_documents="file"``) or one document per
line (``"line"``); a ``.txt.gz``/``.txt.zst`` is read the same way. Records
carry their file and 1-based line number so every problem can be reported
where it is. Reading is streaming: memory does not grow with the input.
"""

import glob
import gzip
import io
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import BinaryIO

import zstandard

from megatron.cli import InputError

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst")
TXT_SUFFIXES = (".txt", ".txt.gz", ".txt.zst")
TXT_DOCUMENT_MODES = ("file", "line")
# The Pile's shards were written with zstd's long mode; allow its largest window.
_ZSTD_MAX_WINDOW = 1 << 31


@dataclass
class RawRecord:
    """One document as read: JSON text (``is_json``) or the document's own text, still as bytes."""

    path: str
    line_number: int
    raw: bytes
    is_json: bool


def expand_inputs(patterns: Sequence[str]) -> list[str]:
    """Files and glob patterns -> sorted, de-duplicated paths; error naming any pattern that matches nothing."""
    paths, unmatched = [], []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        matches = [path for path in matches if os.path.isfile(path)]
        if not matches:
            unmatched.append(pattern)
        paths += [path for path in matches if path not in paths]
    if unmatched:
        raise FileNotFoundError(f"--input files not found: {', '.join(unmatched)}")
    unknown = [path for path in paths if not path.endswith(JSONL_SUFFIXES + TXT_SUFFIXES)]
    if unknown:
        raise InputError(
            f"--input {', '.join(unknown)}: unknown file type; use {', '.join(JSONL_SUFFIXES + TXT_SUFFIXES)}"
        )
    return paths


class CountingReader(io.RawIOBase):
    """Passes reads through and counts the bytes taken from the file on disk (for progress and ETA)."""

    def __init__(self, stream: BinaryIO):
        self._stream = stream
        self.bytes_read = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        count = self._stream.readinto(buffer)
        self.bytes_read += count or 0
        return count


def _open_decompressed(path: str, counter: CountingReader) -> BinaryIO:
    if path.endswith(".gz"):
        return gzip.GzipFile(fileobj=io.BufferedReader(counter))
    if path.endswith(".zst"):
        decompressor = zstandard.ZstdDecompressor(max_window_size=_ZSTD_MAX_WINDOW)
        return io.BufferedReader(decompressor.stream_reader(counter, read_across_frames=True))
    return io.BufferedReader(counter, buffer_size=1 << 20)


class CorpusReader:
    """Iterates the records of several files in order; ``bytes_read`` tells how far into them it is."""

    def __init__(self, paths: Sequence[str], txt_documents: str = "file"):
        if txt_documents not in TXT_DOCUMENT_MODES:
            raise InputError(f"txt_documents must be one of {TXT_DOCUMENT_MODES}, got {txt_documents!r}")
        self.paths = list(paths)
        self.txt_documents = txt_documents
        self.total_bytes = sum(os.path.getsize(path) for path in self.paths)
        self._finished_bytes = 0
        self._counter: CountingReader | None = None

    @property
    def bytes_read(self) -> int:
        return self._finished_bytes + (self._counter.bytes_read if self._counter else 0)

    def __iter__(self) -> Iterator[RawRecord]:
        for path in self.paths:
            try:
                with open(path, "rb") as raw_file:
                    self._counter = CountingReader(raw_file)
                    with _open_decompressed(path, self._counter) as stream:
                        yield from self._records(path, stream)
            except (OSError, EOFError, zstandard.ZstdError) as error:
                raise OSError(f"cannot read input {path}: {error}") from error
            self._finished_bytes += os.path.getsize(path)
            self._counter = None

    def _records(self, path: str, stream: BinaryIO) -> Iterator[RawRecord]:
        is_json = path.endswith(JSONL_SUFFIXES)
        if not is_json and self.txt_documents == "file":
            yield RawRecord(path, 1, stream.read(), is_json=False)
            return
        for line_number, line in enumerate(stream, start=1):
            yield RawRecord(path, line_number, line if is_json else line.rstrip(b"\r\n"), is_json)


def parse_record(record: RawRecord, keys: Sequence[str]) -> tuple[dict[str, str] | None, str]:
    """The text of each key (a .txt record's text goes to the first key), or None and why the record is unusable."""
    if not record.raw.strip():
        return None, "blank line"
    try:
        text = record.raw.decode("utf-8")
    except UnicodeDecodeError as error:
        return None, f"invalid UTF-8 (byte {error.start})"
    if not record.is_json:
        return {keys[0]: text}, ""
    try:
        document = json.loads(text)
    except ValueError as error:
        return None, f"invalid JSON ({error})"
    if not isinstance(document, dict):
        return None, "not a JSON object"
    texts = {}
    for key in keys:
        if key not in document:
            return None, f"missing key {key!r}"
        if not isinstance(document[key], str):
            return None, f"{key!r} is {type(document[key]).__name__}, not a string"
        if not document[key]:
            return None, f"empty {key!r}"
        texts[key] = document[key]
    return texts, ""
