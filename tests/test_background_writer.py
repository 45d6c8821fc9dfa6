"""BackgroundWriter (megatron/checkpoint/background_writer.py) and the manifest's hashing of large files: the
records hashed while writing are those of the files on disk, failed writes surface, and reading a file in
large chunks hashes it whole."""

from __future__ import annotations

import hashlib
import os
from functools import partial

import pytest
import torch

from megatron.checkpoint.background_writer import BackgroundWriter
from megatron.checkpoint.manifest import FileRecord, file_problems


def test_records_hashed_while_writing_are_those_of_the_files(tmp_path):
    (tmp_path / "moments").mkdir()
    tensors = {name: torch.randn(1000 * (i + 1)) for i, name in enumerate(["a.pt", "moments/b.pt", "c.pt"])}
    with BackgroundWriter(tmp_path) as files:
        for name, tensor in tensors.items():
            files.submit(name, partial(torch.save, {"t": tensor}))
        records = files.records()
    assert set(records) == set(tensors)
    for name, record in records.items():
        content = (tmp_path / name).read_bytes()
        assert (record.name, record.size) == (name, len(content))
        assert record.sha256 == hashlib.sha256(content).hexdigest()
        assert torch.equal(torch.load(tmp_path / name)["t"], tensors[name])


def test_a_failed_write_is_raised_by_records_and_by_the_next_submit(tmp_path):
    def failing(stream) -> None:
        stream.write(b"partial")
        raise OSError(28, "No space left on device")

    with BackgroundWriter(tmp_path) as files:
        files.submit("bad.pt", failing)
        with pytest.raises(OSError, match="No space left"):
            files.records()
        with pytest.raises(OSError, match="No space left"):
            files.submit("next.pt", partial(torch.save, {}))


def test_files_larger_than_a_read_chunk_are_hashed_whole(tmp_path):
    content = os.urandom(40 << 20)  # 2.5 chunks of 16 MiB
    (tmp_path / "big").write_bytes(content)
    record = FileRecord("big", len(content), hashlib.sha256(content).hexdigest())
    assert file_problems(tmp_path, record) == []
    (tmp_path / "big").write_bytes(content[:-1] + bytes([content[-1] ^ 1]))
    assert file_problems(tmp_path, record) == ["big does not match its SHA-256 in the manifest (corrupted)"]
