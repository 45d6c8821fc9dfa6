"""`manifest.json`: the size and SHA-256 of every file of a checkpoint.

It is written after every rank's files are complete and before the checkpoint
gets its visible name (commit.py), so a resume can tell a complete
checkpoint from a truncated, corrupted or half-copied one and name the bad file.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from megatron.cli import InputError

MANIFEST = "manifest.json"
_FORMAT = 1


@dataclass(frozen=True)
class FileRecord:
    name: str  # relative to the checkpoint directory
    size: int
    sha256: str


def checkpoint_files(directory: Path) -> list[str]:
    """Every file of the checkpoint but the manifest, relative and sorted."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


_HASH_CHUNK = 16 << 20  # large reads into one reused buffer: fewer system calls, no allocation per chunk
_CACHED_CHUNK = 1 << 20  # written data is hashed and written in pieces that stay in the CPU's cache


def _sha256(path: Path) -> str:
    """The file's SHA-256, read with plain reads (a file truncated meanwhile gives a short read, never the
    SIGBUS a memory map would). hashlib releases the GIL, so threads hash files side by side."""
    digest, buffer = hashlib.sha256(), bytearray(_HASH_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as stream:
        while size := stream.readinto(buffer):
            digest.update(view[:size])
    return digest.hexdigest()


class RecordedFile:
    """A new file, write-only and sequential (torch.save writes its zip so), whose record is computed from the
    bytes as they are written: publishing a large checkpoint then needs no second read of them.

        with RecordedFile(directory, name) as stream:
            torch.save(state, stream)
        records[name] = stream.record
    """

    def __init__(self, directory: Path, name: str) -> None:
        self._name, self._stream = name, open(directory / name, "wb")
        self._digest, self._size = hashlib.sha256(), 0

    def write(self, data: bytes | memoryview) -> int:
        """Hash and write `data` a few MiB at a time: each piece is written while it is still in the CPU's
        cache, so a large tensor is read from memory once, not twice. hashlib releases the GIL."""
        view = memoryview(data).cast("B")
        for start in range(0, view.nbytes, _CACHED_CHUNK):
            piece = view[start:start + _CACHED_CHUNK]
            self._digest.update(piece)
            self._stream.write(piece)
        self._size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self._stream.flush()

    def __enter__(self) -> RecordedFile:
        return self

    def __exit__(self, *exception: object) -> None:
        self._stream.close()

    @property
    def record(self) -> FileRecord:
        return FileRecord(self._name, self._size, self._digest.hexdigest())


def sync_and_drop(path: Path) -> None:
    """Put a finished file on disk and drop it from the page cache: nothing reads it again soon, and the cache
    keeps what is read (a source checkpoint) instead."""
    with open(path, "rb") as stream:
        os.fsync(stream.fileno())
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(stream.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def record_file(directory: Path, name: str, known: Mapping[str, FileRecord] | None = None) -> list[FileRecord]:
    """The file's record, after flushing it to disk (the manifest must not vouch for data still in the page
    cache); a one-item list, for work_split.map_over_ranks. A record in `known` (hashed as it was written) is
    taken if the file still has its size; other files are read and hashed."""
    with open(directory / name, "rb") as stream:
        os.fsync(stream.fileno())
        size = os.fstat(stream.fileno()).st_size
    record = (known or {}).get(name)
    if record is not None and record.size == size:
        return [record]
    return [FileRecord(name, size, _sha256(directory / name))]


def write_durably(path: Path, text: str) -> None:
    """Replace `path` with `text` atomically: a reader sees the old or the new content, never a mix."""
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w", encoding="utf-8") as stream:
        stream.write(text)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(partial, path)
    sync_directory(path.parent)


def sync_directory(directory: Path) -> None:
    """Make renames and new entries in `directory` durable."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_manifest(directory: Path, records: list[FileRecord]) -> None:
    files = {r.name: {"size": r.size, "sha256": r.sha256} for r in sorted(records, key=lambda r: r.name)}
    write_durably(directory / MANIFEST, json.dumps({"format": _FORMAT, "files": files}, indent=1))


def read_manifest(directory: Path) -> list[FileRecord] | None:
    """The records of `directory`'s manifest; None if it has none. Raises ValueError if it is unreadable."""
    path = directory / MANIFEST
    if not path.is_file():
        return None
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
        return [FileRecord(name, int(entry["size"]), str(entry["sha256"])) for name, entry in content["files"].items()]
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise InputError(f"{path} is not a valid manifest ({error!r})") from None


def content_digest(directory: Path) -> str:
    """One SHA-256 for a checkpoint's content: over every file's name, size and SHA-256, from its manifest (else
    from the files, hashed now). Another checkpoint under the same tag has another digest. Raises ValueError
    if the manifest is unreadable."""
    records = read_manifest(directory)
    if records is None:
        records = [FileRecord(name, (directory / name).stat().st_size, _sha256(directory / name))
                   for name in checkpoint_files(directory)]
    listed = [[record.name, record.size, record.sha256] for record in sorted(records, key=lambda r: r.name)]
    return hashlib.sha256(json.dumps(listed).encode()).hexdigest()


def file_problems(directory: Path, record: FileRecord, hashed: bool = True) -> list[str]:
    """What is wrong with one file compared to its record ([] if it matches); `hashed` False compares the
    size only (a quick look before launch, not a verification)."""
    path = directory / record.name
    if not path.is_file():
        return [f"{record.name} is missing"]
    size = path.stat().st_size
    if size != record.size:
        return [f"{record.name} has {size} bytes, the manifest says {record.size} (truncated or overwritten)"]
    if hashed and _sha256(path) != record.sha256:
        return [f"{record.name} does not match its SHA-256 in the manifest (corrupted)"]
    return []
