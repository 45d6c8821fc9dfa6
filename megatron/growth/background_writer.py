"""Write a checkpoint's files on background threads while the caller computes the next ones.

    with BackgroundWriter(staging) as files:
        files.submit("layer_02-model_00-model_states.pt", lambda stream: torch.save(state, stream))
        records = files.records()          # every file written, hashed and on disk; raises a failed write's error

torch.save, SHA-256 and file writes release the GIL for large buffers, so the writing threads, the caller's
reading and growing and the disk overlap. Each file is hashed as it is written (RecordedFile), then flushed
to disk and dropped from the page cache: publishing it needs neither a second read nor a long final fsync,
and a checkpoint larger than RAM does not evict the source being read. At most `threads + queued` files are
held in memory at once; submit() waits for room.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

from megatron.checkpoint_manifest import FileRecord, RecordedFile


class BackgroundWriter:
    """See the module docstring. Leaving the `with` block waits for running writes and drops queued ones."""

    def __init__(self, directory: Path, threads: int = 2, queued: int = 0) -> None:
        self._directory = directory
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="checkpoint-writer")
        self._room = threading.Semaphore(threads + queued)
        self._futures: list[Future[FileRecord]] = []

    def __enter__(self) -> BackgroundWriter:
        return self

    def __exit__(self, *exception: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _write(self, name: str, write: Callable[[BinaryIO], None]) -> FileRecord:
        try:
            with RecordedFile(self._directory, name) as stream:
                write(stream)
                stream.sync()
            return stream.record
        finally:
            self._room.release()

    def submit(self, name: str, write: Callable[[BinaryIO], None]) -> None:
        """Write file `name` (relative to the directory) with `write(stream)` on a background thread."""
        self._raise_failure(done_only=True)
        self._room.acquire()
        try:
            self._futures.append(self._pool.submit(self._write, name, write))
        except BaseException:
            self._room.release()
            raise

    def _raise_failure(self, done_only: bool) -> None:
        for future in self._futures:
            if not done_only or future.done():
                future.result()

    def records(self) -> dict[str, FileRecord]:
        """The records of every file submitted, once all are written; the first failed write's error."""
        self._raise_failure(done_only=False)
        return {record.name: record for record in (future.result() for future in self._futures)}
