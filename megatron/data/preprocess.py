"""Tokenize corpora into mmap indexed datasets (the logic behind tools/preprocess_data.py).

Records are read lazily (``corpus_reader``) and tokenized a chunk at a time,
in worker processes when ``workers > 1``, with a bounded window of chunks in
flight: memory stays bounded on any corpus size and documents keep their
input order. Each key becomes ``{output_prefix}_{key}_document.bin/.idx``,
written under ``.partial`` names and renamed only once every input was read,
so an interrupted or failed run leaves nothing that looks like a dataset (and
an older dataset under that prefix untouched). Inputs that give no document at
all are such a failure. Malformed records are skipped, counted and reported
by file and line. Beside each published pair goes ``.stats.json`` with its
largest token id, which launches check against the vocabulary
(``dataset_check``) without reading the ``.bin``.
"""

import ctypes
import itertools
import multiprocessing
import os
import re
import signal
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from megatron.cli import InputError
from megatron.data.corpus_reader import TXT_SUFFIXES, CorpusReader, RawRecord, parse_record
from megatron.data.dataset_check import record_largest_token_id, stats_file_path
from megatron.data.indexed_dataset import (
    MMapIndexedDatasetBuilder,
    best_fitting_dtype,
    data_file_path,
    index_file_path,
)
from megatron.tokenizer import AbstractTokenizer

# Documents longer than this are tokenized in pieces: a tokenizer's whole-text encoding holds many times the
# text's size in memory at once (docs/reliability.md, "preprocessing one 50 MB single-line document").
PIECE_CHARACTERS = 1 << 20
_WORD_BOUNDARY = re.compile(r"(?<=\S) (?=\S)")

MAX_REPORTED_SKIPS = 100
_NAMED_INPUTS = 5  # inputs listed by name in the no-documents error; the rest are counted
CHUNK_BYTES = 4 << 20
_TEMPORARY_SUFFIX = ".partial"
_PR_SET_PDEATHSIG = 1  # prctl option: the signal a process gets when its parent dies
# Partial outputs of the runs in progress, for abort_in_progress().
_partial_outputs: set[str] = set()


@dataclass
class EncodedChunk:
    """The documents of one chunk, back to back per key, and the records skipped in it."""

    tokens: dict[str, np.ndarray]
    lengths: dict[str, np.ndarray]
    text_bytes: int = 0
    skips: list[tuple[str, int, str]] = field(default_factory=list)


@dataclass
class PreprocessStats:
    documents: int = 0
    tokens: int = 0
    text_bytes: int = 0
    seconds: float = 0.0
    skipped: int = 0
    skip_reasons: Counter = field(default_factory=Counter)
    skipped_examples: list[str] = field(default_factory=list)
    largest_token_ids: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        reasons = self.skip_summary()
        return (
            f"{self.documents} documents, {self.tokens} tokens, {self.text_bytes} bytes of text "
            f"in {self.seconds:.1f} s; {self.skipped} lines skipped" + (f" ({reasons})" if reasons else "")
        )

    def skip_summary(self) -> str:
        return ", ".join(f"{count} {reason}" for reason, count in self.skip_reasons.most_common())


class DocumentEncoder:
    """Parses and tokenizes chunks of records; lives in each worker process."""

    def __init__(self, tokenizer: AbstractTokenizer, keys: Sequence[str], append_eod: bool):
        self.tokenizer = tokenizer
        self.keys = list(keys)
        self.append_eod = append_eod
        self.dtype = best_fitting_dtype(tokenizer.vocab_size)

    def _tokenize(self, texts: list[str]) -> list:
        """Ids of each text: in one batch, except a long one where the tokenizer allows cutting it (piece_cut),
        which is tokenized piece by piece into an int32 array, so that memory stays bounded whatever one
        document's length."""
        cut = self.tokenizer.piece_cut
        ids: list = [None] * len(texts)
        whole = [index for index, text in enumerate(texts) if cut is None or len(text) <= PIECE_CHARACTERS]
        for index, result in zip(whole, self.tokenizer.tokenize_batch([texts[i] for i in whole])):
            ids[index] = result
        for index in sorted(set(range(len(texts))) - set(whole)):
            pieces = long_document_pieces(texts[index], drop_space=cut == "drop")
            ids[index] = np.concatenate([np.asarray(self.tokenizer.tokenize(piece), dtype=np.int32)
                                         for piece in pieces])
        return ids

    def encode_chunk(self, records: list[RawRecord]) -> EncodedChunk:
        """Every key of every valid record, tokenized a whole chunk per key at once; skips in input order."""
        skips, valid = [], []
        for index, record in enumerate(records):
            texts, reason = parse_record(record, self.keys)
            if texts is not None:
                try:
                    valid.append((index, texts, sum(len(text.encode("utf-8")) for text in texts.values())))
                    continue
                except UnicodeEncodeError:
                    reason = "invalid UTF-8 (unpaired surrogate escape)"
            skips.append((index, reason))
        ids_per_key = {key: self._tokenize([texts[key] for _, texts, _ in valid]) for key in self.keys}
        eod = (self.tokenizer.eod,) if self.append_eod else ()
        kept = []
        for position, (index, _, _) in enumerate(valid):
            empty = [key for key in self.keys if not len(ids_per_key[key][position]) and not eod]
            if empty:
                skips.append((index, f"{empty[0]!r} has no tokens"))
            else:
                kept.append(position)
        chunk = EncodedChunk(
            tokens={}, lengths={}, text_bytes=sum(valid[position][2] for position in kept),
            skips=[(records[index].path, records[index].line_number, reason) for index, reason in sorted(skips)],
        )
        for key in self.keys:
            documents = [ids_per_key[key][position] for position in kept]
            lengths = np.fromiter((len(ids) + len(eod) for ids in documents), dtype=np.int64, count=len(documents))
            chunk.lengths[key] = lengths
            tokens = np.fromiter(
                itertools.chain.from_iterable(itertools.chain(ids, eod) for ids in documents),
                dtype=np.int64, count=int(lengths.sum()),
            )
            # Narrow before sending to the parent; ids that do not fit stay wide so the builder reports them.
            limits = np.iinfo(self.dtype)
            fits = not tokens.size or (tokens.min() >= limits.min and tokens.max() <= limits.max)
            chunk.tokens[key] = tokens.astype(self.dtype) if fits else tokens
        return chunk


def long_document_pieces(text: str, size: int | None = None, drop_space: bool = False) -> Iterator[str]:
    """`text` in pieces of at most `size` characters (PIECE_CHARACTERS), each cut at a single space between two
    words, where the tokenizers that allow it start a new token anyway (AbstractTokenizer.piece_cut): the space
    starts the next piece, or is left out (`drop_space`). A stretch with no such space is not cut (a piece then
    holds it whole)."""
    size = size or PIECE_CHARACTERS
    start = 0
    while len(text) - start > size:
        window = text[start + size // 2:start + size]
        cuts = [match.start() for match in _WORD_BOUNDARY.finditer(window)]
        if not cuts:
            later = _WORD_BOUNDARY.search(text, start + size)
            if later is None:
                break
            end = later.start()
        else:
            end = start + size // 2 + cuts[-1]
        yield text[start:end]
        start = end + 1 if drop_space else end
    yield text[start:]


_worker_encoder: DocumentEncoder | None = None
# Workers start as fresh interpreters: fork copies whatever locks the parent's other threads hold at that moment
# (tqdm's monitor, a tokenizer's thread pool, OpenMP's), and a worker that inherits one held waits forever. The
# encoder travels pickled.
_POOL_CONTEXT = multiprocessing.get_context("spawn")


def _init_worker(encoder: DocumentEncoder, parent_pid: int) -> None:
    """Workers leave Ctrl-C and cleanup to the parent, which stops the pool and removes partial outputs.

    On Linux a worker also dies with its parent, even when the parent is
    killed outright, instead of lingering (holding the parent's pipes open).
    """
    global _worker_encoder
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the pool stops workers with SIGTERM: never run the parent's handler
    _partial_outputs.clear()  # the parent's files: only the parent may remove them
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)
    _worker_encoder = encoder


def _encode_in_worker(records: list[RawRecord]) -> EncodedChunk:
    return _worker_encoder.encode_chunk(records)


def output_prefix_for(output_prefix: str, key: str) -> str:
    """GPT-NeoX naming: the data prefix to train on for ``key``."""
    return f"{output_prefix}_{key}_document"


def _chunks(records: Iterable[RawRecord], max_records: int, max_bytes: int) -> Iterator[list[RawRecord]]:
    """Consecutive records, at most ``max_records`` or about ``max_bytes`` of input per chunk."""
    chunk, size = [], 0
    for record in records:
        chunk.append(record)
        size += len(record.raw)
        if len(chunk) >= max_records or size >= max_bytes:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _encoded_chunks(
    chunks: Iterator[list[RawRecord]], encoder: DocumentEncoder, workers: int
) -> Iterator[EncodedChunk]:
    """Encoded chunks in input order; with workers, the next window is queued while this one drains."""
    if workers == 1:
        yield from map(encoder.encode_chunk, chunks)
        return
    # One tokenizer thread per worker: the workers already use every core we were given.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    window = 4 * workers
    with _POOL_CONTEXT.Pool(workers, initializer=_init_worker, initargs=(encoder, os.getpid())) as pool:
        pending = None
        while batch := list(itertools.islice(chunks, window)):
            queued = pool.imap(_encode_in_worker, batch)
            if pending is not None:
                yield from pending
            pending = queued
        if pending is not None:
            yield from pending


class _Progress:
    """tqdm over input bytes (MB/s, ETA) with documents/s and tokens/s beside it."""

    def __init__(self, reader: CorpusReader, enabled: bool, log_interval: int):
        self._reader = reader
        self._log_interval = log_interval
        self._last_documents = 0
        self._start = time.time()
        self._bar = tqdm(
            total=reader.total_bytes, unit="B", unit_scale=True, disable=not enabled, dynamic_ncols=True,
            desc="preprocessing",
        )

    def update(self, stats: PreprocessStats, final: bool = False) -> None:
        if not final and stats.documents + stats.skipped - self._last_documents < self._log_interval:
            return
        self._last_documents = stats.documents + stats.skipped
        elapsed = max(time.time() - self._start, 1e-9)
        self._bar.set_postfix_str(
            f"{stats.documents / elapsed:.0f} docs/s, {stats.tokens / elapsed / 1e6:.2f}M tok/s", refresh=False
        )
        self._bar.update(self._reader.bytes_read - self._bar.n)

    def close(self) -> None:
        self._bar.close()


def preprocess_corpus(
    input_paths: Sequence[str],
    output_prefix: str,
    tokenizer: AbstractTokenizer,
    jsonl_keys: Sequence[str] = ("text",),
    append_eod: bool = False,
    workers: int = 1,
    log_interval: int = 100,
    chunk_size: int = 256,
    txt_documents: str = "file",
    show_progress: bool = True,
) -> PreprocessStats:
    """Tokenize corpus files (see ``corpus_reader``) into one indexed dataset per key; returns the counts."""
    _check_arguments(input_paths, jsonl_keys, workers, log_interval, chunk_size)
    start = time.time()
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    encoder = DocumentEncoder(tokenizer, jsonl_keys, append_eod)
    reader = CorpusReader(input_paths, txt_documents)
    finals = [output_prefix_for(output_prefix, key) for key in jsonl_keys]
    partials = [
        path + _TEMPORARY_SUFFIX for prefix in finals for path in (data_file_path(prefix), index_file_path(prefix))
    ]
    stats = PreprocessStats()
    progress = _Progress(reader, show_progress, log_interval)
    _partial_outputs.update(partials)
    try:
        builders = {
            key: MMapIndexedDatasetBuilder(data_file_path(prefix) + _TEMPORARY_SUFFIX, encoder.dtype)
            for key, prefix in zip(jsonl_keys, finals)
        }
        for chunk in _encoded_chunks(_chunks(reader, chunk_size, CHUNK_BYTES), encoder, workers):
            _write(chunk, builders, stats)
            progress.update(stats)
        progress.update(stats, final=True)
        if stats.documents == 0:  # before anything is published: an earlier good dataset stays as it was
            raise InputError(_no_documents_message(input_paths, stats))
        for key, prefix in zip(jsonl_keys, finals):
            builders[key].finalize(index_file_path(prefix) + _TEMPORARY_SUFFIX)
        for key, prefix in zip(jsonl_keys, finals):
            _publish(prefix, stats.largest_token_ids[key])
    finally:
        progress.close()
        _remove(partials)
    stats.seconds = time.time() - start
    return stats


def _remove(partials: Iterable[str]) -> None:
    for path in list(partials):
        _partial_outputs.discard(path)
        if os.path.exists(path):
            os.remove(path)


def abort_in_progress() -> None:
    """Stop the workers and delete the partial outputs of runs in progress.

    For signal handlers: unwinding an exception through a worker pool from a
    signal can deadlock, so the handler calls this and exits the process.
    """
    for child in multiprocessing.active_children():
        child.terminate()
    _remove(_partial_outputs)


def _publish(prefix: str, largest_token_id: int) -> None:
    """Rename the finished pair into place, then record its largest token id (``dataset_check``).

    An older .idx and stats file go first, so no moment pairs old and new files.
    """
    for path in (index_file_path(prefix), stats_file_path(prefix)):
        if os.path.exists(path):
            os.remove(path)
    os.replace(data_file_path(prefix) + _TEMPORARY_SUFFIX, data_file_path(prefix))
    os.replace(index_file_path(prefix) + _TEMPORARY_SUFFIX, index_file_path(prefix))
    record_largest_token_id(prefix, largest_token_id)


def _no_documents_message(input_paths: Sequence[str], stats: PreprocessStats) -> str:
    names = ", ".join(input_paths[:_NAMED_INPUTS])
    if len(input_paths) > _NAMED_INPUTS:
        names += f" and {len(input_paths) - _NAMED_INPUTS} more"
    if stats.skipped:
        why = f"every line was skipped ({stats.skip_summary()}; first: {stats.skipped_examples[0]})"
    else:
        why = "the inputs are empty"
    return (
        f"no documents in {names}: {why}; give text (.jsonl records holding the --jsonl-keys, or UTF-8 .txt "
        f"files); nothing was written"
    )


def _write(chunk: EncodedChunk, builders: dict[str, MMapIndexedDatasetBuilder], stats: PreprocessStats) -> None:
    for path, line_number, reason in chunk.skips:
        stats.skipped += 1
        stats.skip_reasons[reason.split(" (")[0]] += 1
        if len(stats.skipped_examples) < MAX_REPORTED_SKIPS:
            stats.skipped_examples.append(f"{path}:{line_number}: {reason}")
    for key, builder in builders.items():
        tokens = chunk.tokens[key]
        builder.add_documents(tokens, chunk.lengths[key])
        stats.tokens += int(tokens.size)
        if tokens.size:
            largest = int(tokens.max())
            stats.largest_token_ids[key] = max(largest, stats.largest_token_ids.get(key, largest))
    stats.documents += len(next(iter(chunk.lengths.values())))
    stats.text_bytes += chunk.text_bytes


def _check_arguments(
    input_paths: Sequence[str], jsonl_keys: Sequence[str], workers: int, log_interval: int, chunk_size: int
) -> None:
    if not input_paths:
        raise InputError("--input names no files")
    missing = [path for path in input_paths if not os.path.isfile(path)]
    if missing:
        raise FileNotFoundError(f"--input files not found: {', '.join(missing)}")
    if not jsonl_keys or len(set(jsonl_keys)) != len(jsonl_keys):
        raise InputError(f"--jsonl-keys must name distinct keys, got {list(jsonl_keys)}")
    if any(path.endswith(TXT_SUFFIXES) for path in input_paths) and len(jsonl_keys) != 1:
        raise InputError(
            f"--jsonl-keys {list(jsonl_keys)}: .txt inputs hold one text per document, so give one key "
            f"(it names the output)"
        )
    if workers < 1 or log_interval < 1 or chunk_size < 1:
        raise InputError(
            f"--workers, --log-interval and chunk_size must be at least 1, got {workers}, {log_interval}, {chunk_size}"
        )
