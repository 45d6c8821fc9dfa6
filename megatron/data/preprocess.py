"""Tokenize JSON-lines corpora into mmap indexed datasets (the logic behind tools/preprocess_data.py).

Input lines are read lazily and tokenized in chunks (in worker processes when
``workers > 1``) with at most two windows of chunks in flight, so memory stays
bounded on any corpus size while documents keep their input order. Each
``key`` becomes ``{output_prefix}_{key}_document.bin/.idx``; both are written
under temporary names and renamed only when every input was read, so a failed
run leaves no output behind. Malformed lines are skipped and counted, never fatal.
"""

import gzip
import itertools
import json
import multiprocessing
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from megatron.data.indexed_dataset import (
    MMapIndexedDatasetBuilder,
    best_fitting_dtype,
    data_file_path,
    index_file_path,
)
from megatron.tokenizer import AbstractTokenizer

MAX_REPORTED_SKIPS = 100
_TEMPORARY_SUFFIX = ".partial"

# (path, 1-based line number, raw bytes of the line)
Line = tuple[str, int, bytes]


@dataclass
class EncodedLine:
    """One input line: its token arrays per key, or why it was skipped."""

    path: str
    line_number: int
    tokens: dict[str, np.ndarray] | None = None
    text_bytes: int = 0
    skip_reason: str | None = None


@dataclass
class PreprocessStats:
    documents: int = 0
    tokens: int = 0
    text_bytes: int = 0
    seconds: float = 0.0
    skipped: int = 0
    skipped_examples: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"{self.documents} documents, {self.tokens} tokens, {self.text_bytes} bytes of text "
            f"in {self.seconds:.1f} s; {self.skipped} lines skipped"
        )


class DocumentEncoder:
    """Parses and tokenizes chunks of lines; lives in each worker process."""

    def __init__(self, tokenizer: AbstractTokenizer, keys: Sequence[str], append_eod: bool):
        self.tokenizer = tokenizer
        self.keys = list(keys)
        self.append_eod = append_eod
        self.dtype = best_fitting_dtype(tokenizer.vocab_size)

    def _texts(self, raw: bytes) -> tuple[dict[str, str] | None, str | None]:
        if not raw.strip():
            return None, "blank line"
        try:
            record = json.loads(raw)
        except ValueError as error:
            return None, f"invalid JSON ({error})"
        if not isinstance(record, dict):
            return None, "not a JSON object"
        texts = {}
        for key in self.keys:
            if key not in record:
                return None, f"missing key {key!r}"
            if not isinstance(record[key], str):
                return None, f"{key!r} is {type(record[key]).__name__}, not a string"
            if not record[key]:
                return None, f"empty {key!r}"
            texts[key] = record[key]
        return texts, None

    def encode_chunk(self, lines: list[Line]) -> list[EncodedLine]:
        """One result per line, in order; texts are tokenized a whole chunk per key at once."""
        results, valid = [], []
        for path, line_number, raw in lines:
            texts, reason = self._texts(raw)
            results.append(EncodedLine(path, line_number, skip_reason=reason))
            if texts is not None:
                valid.append((results[-1], texts))
        eod = [self.tokenizer.eod] if self.append_eod else []
        ids_per_key = {key: self.tokenizer.tokenize_batch([texts[key] for _, texts in valid]) for key in self.keys}
        for position, (result, texts) in enumerate(valid):
            result.tokens = {key: np.asarray(ids_per_key[key][position] + eod, dtype=self.dtype) for key in self.keys}
            result.text_bytes = sum(len(text.encode("utf-8")) for text in texts.values())
            empty = [key for key, tokens in result.tokens.items() if tokens.size == 0]
            if empty:
                result.skip_reason = f"{empty[0]!r} has no tokens"
        return results


_worker_encoder: DocumentEncoder | None = None


def _init_worker(encoder: DocumentEncoder) -> None:
    global _worker_encoder
    _worker_encoder = encoder


def _encode_in_worker(lines: list[Line]) -> list[EncodedLine]:
    return _worker_encoder.encode_chunk(lines)


def output_prefix_for(output_prefix: str, key: str) -> str:
    """GPT-NeoX naming: the data prefix to train on for ``key``."""
    return f"{output_prefix}_{key}_document"


def _read_lines(paths: Sequence[str]) -> Iterator[Line]:
    for path in paths:
        opener = gzip.open if path.endswith(".gz") else open
        try:
            with opener(path, "rb") as stream:
                for line_number, raw in enumerate(stream, start=1):
                    yield path, line_number, raw
        except (OSError, EOFError) as error:
            raise OSError(f"cannot read input {path}: {error}") from error


def _chunks(items: Iterable[Line], size: int) -> Iterator[list[Line]]:
    iterator = iter(items)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk


def _encoded_chunks(
    chunks: Iterator[list[Line]], encoder: DocumentEncoder, workers: int
) -> Iterator[list[EncodedLine]]:
    """Encoded chunks in input order; with workers, the next window is queued while this one drains."""
    if workers == 1:
        yield from map(encoder.encode_chunk, chunks)
        return
    window = 4 * workers
    with multiprocessing.Pool(workers, initializer=_init_worker, initargs=(encoder,)) as pool:
        pending = None
        while batch := list(itertools.islice(chunks, window)):
            queued = pool.imap(_encode_in_worker, batch)
            if pending is not None:
                yield from pending
            pending = queued
        if pending is not None:
            yield from pending


def preprocess_jsonl(
    input_paths: Sequence[str],
    output_prefix: str,
    tokenizer: AbstractTokenizer,
    jsonl_keys: Sequence[str] = ("text",),
    append_eod: bool = False,
    workers: int = 1,
    log_interval: int = 100,
    chunk_size: int = 256,
    show_progress: bool = True,
) -> PreprocessStats:
    """Tokenize ``.jsonl``/``.jsonl.gz`` files into one indexed dataset per key; returns the counts."""
    _check_arguments(input_paths, jsonl_keys, workers, log_interval, chunk_size)
    start = time.time()
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    encoder = DocumentEncoder(tokenizer, jsonl_keys, append_eod)
    finals = {key: output_prefix_for(output_prefix, key) for key in jsonl_keys}
    temporaries = [
        path + _TEMPORARY_SUFFIX
        for prefix in finals.values()
        for path in (data_file_path(prefix), index_file_path(prefix))
    ]
    stats = PreprocessStats()
    try:
        builders = {
            key: MMapIndexedDatasetBuilder(data_file_path(prefix) + _TEMPORARY_SUFFIX, encoder.dtype)
            for key, prefix in finals.items()
        }
        chunks = _chunks(_read_lines(input_paths), chunk_size)
        with tqdm(unit="lines", disable=not show_progress, miniters=log_interval) as progress:
            for encoded_chunk in _encoded_chunks(chunks, encoder, workers):
                for encoded in encoded_chunk:
                    _write(encoded, builders, stats)
                progress.update(len(encoded_chunk))
        for key, prefix in finals.items():
            builders[key].finalize(index_file_path(prefix) + _TEMPORARY_SUFFIX)
        for prefix in finals.values():
            for final in (data_file_path(prefix), index_file_path(prefix)):
                os.replace(final + _TEMPORARY_SUFFIX, final)
    finally:
        for path in temporaries:
            if os.path.exists(path):
                os.remove(path)
    stats.seconds = time.time() - start
    return stats


def _write(encoded: EncodedLine, builders: dict[str, MMapIndexedDatasetBuilder], stats: PreprocessStats) -> None:
    if encoded.skip_reason is not None:
        stats.skipped += 1
        if len(stats.skipped_examples) < MAX_REPORTED_SKIPS:
            stats.skipped_examples.append(f"{encoded.path}:{encoded.line_number}: {encoded.skip_reason}")
        return
    for key, tokens in encoded.tokens.items():
        builders[key].add_item(tokens)
        builders[key].end_document()
        stats.tokens += tokens.size
    stats.documents += 1
    stats.text_bytes += encoded.text_bytes


def _check_arguments(
    input_paths: Sequence[str], jsonl_keys: Sequence[str], workers: int, log_interval: int, chunk_size: int
) -> None:
    if not input_paths:
        raise ValueError("--input names no files")
    missing = [path for path in input_paths if not os.path.isfile(path)]
    if missing:
        raise FileNotFoundError(f"--input files not found: {', '.join(missing)}")
    if not jsonl_keys or len(set(jsonl_keys)) != len(jsonl_keys):
        raise ValueError(f"--jsonl-keys must name distinct keys, got {list(jsonl_keys)}")
    if workers < 1 or log_interval < 1 or chunk_size < 1:
        raise ValueError(
            f"--workers, --log-interval and chunk_size must be at least 1, got {workers}, {log_interval}, {chunk_size}"
        )
