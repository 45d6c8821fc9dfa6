"""tools/preprocess_data.py and its modules: input formats, order, skipped lines, exact tokens, atomic outputs."""

import gzip
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import zstandard
from tokenizers import Tokenizer

from megatron.data.corpus_reader import RawRecord, expand_inputs
from megatron.data.dataset_check import dataset_problems
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.preprocess import _chunks, output_prefix_for, preprocess_corpus
from megatron.tokenizer import AbstractTokenizer, build_tokenizer
from megatron.tokenizer.train import train_byte_level_bpe, train_sentencepiece

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAR_LEVEL = build_tokenizer("CharLevelTokenizer")


def write_jsonl(path, records):
    """records: dicts, or raw strings written as they are."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as stream:
        for record in records:
            stream.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    return str(path)


def documents_of(prefix):
    dataset = MMapIndexedDataset(prefix)
    return [dataset[i].tolist() for i in range(len(dataset))]


def test_several_workers_keep_input_order(tmp_path):
    texts = [f"document {i} " + "x" * (i % 7) for i in range(60)]
    first = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts[:35]])
    second = write_jsonl(tmp_path / "b.jsonl.gz", [{"text": t} for t in texts[35:]])
    stats = preprocess_corpus(
        [first, second], str(tmp_path / "out"), CHAR_LEVEL, append_eod=True, workers=2, chunk_size=3,
        show_progress=False,
    )
    expected = [list(t.encode()) + [CHAR_LEVEL.eod] for t in texts]
    assert documents_of(output_prefix_for(str(tmp_path / "out"), "text")) == expected
    assert (stats.documents, stats.tokens, stats.skipped) == (60, sum(map(len, expected)), 0)
    assert stats.text_bytes == sum(len(t.encode()) for t in texts)


def test_malformed_lines_are_skipped_and_reported_with_line_numbers(tmp_path):
    path = write_jsonl(
        tmp_path / "mixed.jsonl",
        [{"text": "good one"}, "{broken json", {"text": 7}, {"title": "no text"}, "", {"text": ""}, "[1, 2]",
         {"text": "good two"}],
    )
    with open(path, "ab") as stream:
        stream.write(b'{"text": "bad \xff utf8"}\n{"text": "good three"}\n')
    stats = preprocess_corpus([path], str(tmp_path / "out"), CHAR_LEVEL, workers=2, chunk_size=2, show_progress=False)
    expected = [list(b"good one"), list(b"good two"), list(b"good three")]
    assert documents_of(str(tmp_path / "out_text_document")) == expected
    assert stats.skipped == 7
    locations = [example.split(": ", 1)[0] for example in stats.skipped_examples]
    assert locations == [f"{path}:{n}" for n in (2, 3, 4, 5, 6, 7, 9)]
    reasons = " | ".join(stats.skipped_examples)
    for reason in ("invalid JSON", "'text' is int", "missing key 'text'", "blank line", "empty 'text'", "not a JSON"):
        assert reason in reasons


@pytest.fixture(scope="module")
def hf_tokenizer_file(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf")
    texts = [f"sample sentence number {i}, with words." for i in range(50)]
    train_byte_level_bpe(texts, 320, str(directory / "tokenizer.json"))
    return str(directory / "tokenizer.json")


def test_output_equals_tokenizing_directly(tmp_path, hf_tokenizer_file):
    tokenizer = build_tokenizer("HFTokenizer", hf_tokenizer_file)
    texts = ["Hello there, sample sentence.", "Numbers 12345 and ünïcode ✓", "words words words"]
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    preprocess_corpus([path], str(tmp_path / "out"), tokenizer, append_eod=True, show_progress=False)
    dataset = MMapIndexedDataset(str(tmp_path / "out_text_document"))
    assert dataset.dtype == np.uint16
    assert [dataset[i].tolist() for i in range(3)] == [tokenizer.tokenize(t) + [tokenizer.eod] for t in texts]
    assert tokenizer.detokenize(dataset[1]) == texts[1]


def test_one_dataset_per_key_and_lines_missing_a_key_skipped_for_all(tmp_path):
    path = write_jsonl(
        tmp_path / "in.jsonl", [{"title": "A", "text": "alpha"}, {"text": "no title"}, {"title": "C", "text": "gamma"}]
    )
    keys = ["text", "title"]
    stats = preprocess_corpus([path], str(tmp_path / "out"), CHAR_LEVEL, jsonl_keys=keys, show_progress=False)
    assert documents_of(str(tmp_path / "out_text_document")) == [list(b"alpha"), list(b"gamma")]
    assert documents_of(str(tmp_path / "out_title_document")) == [list(b"A"), list(b"C")]
    assert stats.skipped_examples == [f"{path}:2: missing key 'title'"]


def test_failed_run_leaves_no_output(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": f"doc {i}"} for i in range(500)])
    corrupt = tmp_path / "corrupt.jsonl.gz"
    corrupt.write_bytes(b"this is not gzip data")
    out_dir = tmp_path / "out"
    with pytest.raises(OSError, match="cannot read input .*corrupt.jsonl.gz"):
        preprocess_corpus(
            [good, str(corrupt)], str(out_dir / "x"), CHAR_LEVEL, workers=2, chunk_size=16, show_progress=False
        )
    assert os.listdir(out_dir) == []


def test_missing_input_is_named_before_any_work(tmp_path):
    with pytest.raises(FileNotFoundError, match="--input files not found: .*absent.jsonl"):
        preprocess_corpus([str(tmp_path / "absent.jsonl")], str(tmp_path / "x"), CHAR_LEVEL, show_progress=False)


def run_tool(*args):
    return subprocess.run(
        [sys.executable, "tools/preprocess_data.py", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )


def test_command_line(tmp_path, hf_tokenizer_file):
    first = write_jsonl(tmp_path / "a.jsonl", [{"text": "one"}, "oops", {"text": "two"}])
    second = write_jsonl(tmp_path / "b.jsonl.gz", [{"text": "three"}])
    result = run_tool(
        "--input", f"{first},{second}", "--output-prefix", str(tmp_path / "cli"), "--tokenizer-type", "HFTokenizer",
        "--vocab-file", hf_tokenizer_file, "--append-eod", "--workers", "2", "--log-interval", "1",
    )
    assert result.returncode == 0, result.stderr
    assert "done: 3 documents" in result.stdout and "1 lines skipped" in result.stdout
    assert f"skipped {first}:2: invalid JSON" in result.stderr
    assert len(MMapIndexedDataset(str(tmp_path / "cli_text_document"))) == 3
    failed = run_tool("--input", str(tmp_path / "none.jsonl"), "--output-prefix", str(tmp_path / "x"),
                      "--tokenizer-type", "CharLevelTokenizer")
    assert failed.returncode == 1
    assert failed.stderr.strip().endswith(f"error: --input files not found: {tmp_path / 'none.jsonl'}")


def write_zst(path, lines):
    with open(path, "wb") as stream:
        stream.write(zstandard.ZstdCompressor().compress("".join(line + "\n" for line in lines).encode()))
    return str(path)


def test_every_input_format_and_globs_in_order(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "plain"}])
    write_jsonl(tmp_path / "b.jsonl.gz", [{"text": "gzipped"}])
    write_zst(tmp_path / "c.jsonl.zst", [json.dumps({"text": "zstd one"}), json.dumps({"text": "zstd two"})])
    (tmp_path / "d.txt").write_text("a whole file\nis one document\n")
    inputs = expand_inputs([str(tmp_path / "*.json*"), str(tmp_path / "d.txt"), str(tmp_path / "a.jsonl")])
    assert [os.path.basename(p) for p in inputs] == ["a.jsonl", "b.jsonl.gz", "c.jsonl.zst", "d.txt"]
    preprocess_corpus(inputs, str(tmp_path / "out"), CHAR_LEVEL, workers=2, chunk_size=1, show_progress=False)
    texts = ["plain", "gzipped", "zstd one", "zstd two", "a whole file\nis one document\n"]
    assert documents_of(str(tmp_path / "out_text_document")) == [list(t.encode()) for t in texts]


def test_txt_one_document_per_line_reports_blank_lines(tmp_path):
    (tmp_path / "lines.txt").write_text("first line\n\nsecond line\r\nthird\n")
    stats = preprocess_corpus(
        [str(tmp_path / "lines.txt")], str(tmp_path / "out"), CHAR_LEVEL, txt_documents="line", show_progress=False
    )
    expected = [list(b"first line"), list(b"second line"), list(b"third")]
    assert documents_of(str(tmp_path / "out_text_document")) == expected
    assert stats.skipped_examples == [f"{tmp_path / 'lines.txt'}:2: blank line"]


def test_glob_matching_nothing_and_unknown_types_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="--input files not found: .*nothing-\\*.jsonl"):
        expand_inputs([str(tmp_path / "nothing-*.jsonl")])
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="data.csv: unknown file type"):
        expand_inputs([str(tmp_path / "data.csv")])


def test_skip_reasons_are_counted_in_the_summary(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(
        b'{"text": "ok"}\n{bad\n{"text": "\xff\xfe"}\n{"text": "\\ud800 lone surrogate"}\n{"x": 1}\n{bad\n'
    )
    stats = preprocess_corpus([str(path)], str(tmp_path / "out"), CHAR_LEVEL, show_progress=False)
    assert stats.skipped_examples[1:3] == [
        f"{path}:3: invalid UTF-8 (byte 10)", f"{path}:4: invalid UTF-8 (unpaired surrogate escape)"
    ]
    assert stats.summary().endswith("5 lines skipped (2 invalid JSON, 2 invalid UTF-8, 1 missing key 'text')")


class LargeVocabulary(AbstractTokenizer):
    """Ids past uint16, to check the int32 output."""

    vocab_size, eod, pad = 100_000, 99_999, 99_999

    def tokenize(self, text):
        return [70_000 + ord(c) for c in text]

    def detokenize(self, ids):
        return "".join(chr(i - 70_000) for i in ids)


def test_token_dtype_follows_the_vocabulary(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": "abc"}])
    preprocess_corpus([path], str(tmp_path / "big"), LargeVocabulary(), append_eod=True, show_progress=False)
    dataset = MMapIndexedDataset(str(tmp_path / "big_text_document"))
    assert dataset.dtype == np.int32 and dataset[0].tolist() == [70_097, 70_098, 70_099, 99_999]
    preprocess_corpus([path], str(tmp_path / "small"), CHAR_LEVEL, show_progress=False)
    assert MMapIndexedDataset(str(tmp_path / "small_text_document")).dtype == np.uint16


def test_chunks_are_bounded_by_records_and_bytes():
    records = [RawRecord("f", i, b"x" * size, True) for i, size in enumerate([10, 10, 500, 10, 10, 10])]
    assert [len(chunk) for chunk in _chunks(records, max_records=4, max_bytes=100)] == [3, 3]
    assert [len(chunk) for chunk in _chunks(records, max_records=2, max_bytes=10**6)] == [2, 2, 2]


@pytest.mark.parametrize("kind", ["GPT2BPETokenizer", "SPMTokenizer"])
def test_other_tokenizer_types_preprocess_exactly(tmp_path, hf_tokenizer_file, kind):
    texts = ["sample sentence one.", "Another sample, with ünïcode ✓"]
    if kind == "GPT2BPETokenizer":
        files = Tokenizer.from_file(hf_tokenizer_file).model.save(str(tmp_path))
    else:
        train_sentencepiece(texts * 30, 300, "unigram", str(tmp_path / "spm.model"))
        files = [str(tmp_path / "spm.model")]
    tokenizer = build_tokenizer(kind, *files)
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    preprocess_corpus([path], str(tmp_path / "out"), tokenizer, append_eod=True, workers=2, show_progress=False)
    expected = [tokenizer.tokenize(t) + [tokenizer.eod] for t in texts]
    assert documents_of(str(tmp_path / "out_text_document")) == expected


def slow_corpus(tmp_path, count=80_000):
    return write_jsonl(tmp_path / "big.jsonl", [{"text": f"document {i} " * 40} for i in range(count)])


@pytest.mark.parametrize("signal_number", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_interrupted_run_leaves_no_complete_looking_output(tmp_path, signal_number):
    corpus = slow_corpus(tmp_path)
    out = tmp_path / "out"
    process = subprocess.Popen(
        [sys.executable, "tools/preprocess_data.py", "--input", corpus, "--output-prefix", str(out / "x"),
         "--tokenizer-type", "CharLevelTokenizer", "--workers", "2", "--no-progress"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.time() + 60
    partial = out / "x_text_document.bin.partial"
    while not partial.exists() or os.path.getsize(partial) == 0:
        assert time.time() < deadline and process.poll() is None, "preprocessing never started writing"
        time.sleep(0.05)
    process.send_signal(signal_number)
    _, stderr = process.communicate(timeout=60)
    names = os.listdir(out)
    assert "x_text_document.bin" not in names and "x_text_document.idx" not in names
    if signal_number != signal.SIGKILL:
        assert process.returncode == 130 and "interrupted: no output written" in stderr
        assert names == []


def test_rerun_replaces_an_older_dataset_whole(tmp_path):
    first = write_jsonl(tmp_path / "one.jsonl", [{"text": "old"}])
    second = write_jsonl(tmp_path / "two.jsonl", [{"text": "new"}, {"text": "newer"}])
    preprocess_corpus([first], str(tmp_path / "out"), CHAR_LEVEL, show_progress=False)
    preprocess_corpus([second], str(tmp_path / "out"), CHAR_LEVEL, show_progress=False)
    assert documents_of(str(tmp_path / "out_text_document")) == [list(b"new"), list(b"newer")]


def test_command_line_progress_and_summary(tmp_path):
    path = write_zst(tmp_path / "in.jsonl.zst", [json.dumps({"text": f"doc {i}"}) for i in range(300)] + ["{bad"])
    result = run_tool("--input", str(tmp_path / "*.jsonl.zst"), "--output-prefix", str(tmp_path / "o"),
                      "--tokenizer-type", "CharLevelTokenizer", "--log-interval", "10")
    assert result.returncode == 0, result.stderr
    assert "docs/s" in result.stderr and "tok/s" in result.stderr and "B/s" in result.stderr
    assert "done: 300 documents" in result.stdout and "1 lines skipped (1 invalid JSON)" in result.stdout
    assert f"skipped {path}:301: invalid JSON" in result.stderr


def test_dataset_stats_tool(tmp_path, hf_tokenizer_file):
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": "sample sentence number 1"}, {"text": "sample " * 30}])
    preprocess_corpus([path], str(tmp_path / "d"), build_tokenizer("HFTokenizer", hf_tokenizer_file), append_eod=True,
                      show_progress=False)
    result = subprocess.run(
        [sys.executable, "tools/dataset_stats.py", str(tmp_path / "d_text_document"), "--tokenizer-type", "HFTokenizer",
         "--vocab-file", hf_tokenizer_file], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    dataset = MMapIndexedDataset(str(tmp_path / "d_text_document"))
    assert f"2 documents, 2 sequences, {int(dataset.sizes.sum())} tokens (uint16)" in result.stdout
    histogram = [line for line in result.stdout.splitlines() if line.startswith("  [")]
    assert sum(int(line.split(")")[1].split()[0]) for line in histogram) == 2
    assert f"first {int(dataset.sizes[0])} tokens: 'sample sentence number 1'" in result.stdout
    with open(tmp_path / "d_text_document.bin", "ab") as stream:
        stream.write(b"\0\0")
    broken = subprocess.run([sys.executable, "tools/dataset_stats.py", str(tmp_path / "d_text_document")],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert broken.returncode == 1 and "truncated or mismatched" in broken.stderr


def test_no_documents_is_an_error_that_keeps_the_existing_dataset(tmp_path, hf_tokenizer_file):
    """A binary file and an empty one give no document: exit 1 naming them, and the good dataset stays whole."""
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": "sample sentence"}, {"text": "with words"}])
    common = ["--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "HFTokenizer", "--vocab-file",
              hf_tokenizer_file, "--workers", "2", "--no-progress"]
    assert run_tool("--input", good, *common).returncode == 0
    prefix = str(tmp_path / "out_text_document")
    before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path) if name.startswith("out_")}
    assert set(before) == {"out_text_document.bin", "out_text_document.idx", "out_text_document.stats.json"}
    binary = tmp_path / "a.txt"
    binary.write_bytes(bytes(range(256)) * 40)
    empty = tmp_path / "b.jsonl"
    empty.write_bytes(b"")
    result = run_tool("--input", f"{binary},{empty}", *common)
    assert result.returncode == 1
    assert f"error: no documents in {binary}, {empty}: every line was skipped (1 invalid UTF-8; " in result.stderr
    after = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path) if name.startswith("out_")}
    assert after == before
    assert len(MMapIndexedDataset(prefix)) == 2
    with pytest.raises(ValueError, match=f"no documents in {empty}: the inputs are empty"):
        preprocess_corpus([str(empty)], str(tmp_path / "out"), CHAR_LEVEL, show_progress=False)
    assert {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path) if name.startswith("out_")} == before


def test_published_datasets_record_their_largest_token_id(tmp_path):
    """PREFIX.stats.json: the .bin's size and mtime and its largest id, so launches need not scan the .bin."""
    path = write_jsonl(tmp_path / "in.jsonl", [{"title": "Az", "text": "abc~"}, {"title": "B", "text": "z"}])
    preprocess_corpus([path], str(tmp_path / "out"), CHAR_LEVEL, jsonl_keys=["text", "title"], workers=2,
                      chunk_size=1, show_progress=False)
    for key, largest in (("text", ord("~")), ("title", ord("z"))):
        prefix = output_prefix_for(str(tmp_path / "out"), key)
        status = os.stat(prefix + ".bin")
        with open(prefix + ".stats.json") as stream:
            assert json.load(stream) == {
                "bin_bytes": status.st_size, "bin_mtime_ns": status.st_mtime_ns, "max_token_id": largest
            }
        assert dataset_problems("data_path", prefix, largest + 1) == []
        assert f"token ids up to {largest} but" in dataset_problems("data_path", prefix, largest)[0]
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".lock")]  # read, never scanned
    preprocess_corpus([write_jsonl(tmp_path / "two.jsonl", [{"text": "a"}])], str(tmp_path / "out"), CHAR_LEVEL,
                      show_progress=False)
    with open(output_prefix_for(str(tmp_path / "out"), "text") + ".stats.json") as stream:
        assert json.load(stream)["max_token_id"] == ord("a")


def natural_text() -> str:
    """About 300 kB of English prose and code with every kind of whitespace run: CPython's own sources."""
    import inspect
    import argparse as one
    import difflib as two
    import textwrap as three

    return "\n\n".join(inspect.getsource(module) for module in (one, two, three))


@pytest.mark.parametrize("kind", ["HFTokenizer", "SPMTokenizer-unigram", "SPMTokenizer-bpe", "CharLevelTokenizer"])
def test_a_long_document_tokenized_in_pieces_gives_the_whole_texts_ids(tmp_path, hf_tokenizer_file, kind,
                                                                          monkeypatch):
    """Documents above PIECE_CHARACTERS are tokenized in pieces cut between words, with the ids of the whole text,
    where the tokenizer allows it: encoding a long document whole holds many times its size in memory."""
    from megatron.data import preprocess

    if kind.startswith("SPMTokenizer"):
        train_sentencepiece([natural_text()[:50000]], 400, kind.split("-")[1], str(tmp_path / "spm.model"))
        tokenizer = build_tokenizer("SPMTokenizer", str(tmp_path / "spm.model"))
    else:
        tokenizer = build_tokenizer(kind, hf_tokenizer_file if kind == "HFTokenizer" else None)
    assert tokenizer.piece_cut in ("keep", "drop")
    text = natural_text()
    monkeypatch.setattr(preprocess, "PIECE_CHARACTERS", 4096)
    pieces = list(preprocess.long_document_pieces(text, drop_space=tokenizer.piece_cut == "drop"))
    assert len(pieces) >= 40 and max(map(len, pieces)) <= 4096
    assert (" " if tokenizer.piece_cut == "drop" else "").join(pieces) == text
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": text}, {"text": "short one"}])
    preprocess_corpus([path], str(tmp_path / "out"), tokenizer, append_eod=True, show_progress=False)
    dataset = MMapIndexedDataset(str(tmp_path / "out_text_document"))
    assert dataset[0].tolist() == tokenizer.tokenize(text) + [tokenizer.eod]
    assert dataset[1].tolist() == tokenizer.tokenize("short one") + [tokenizer.eod]


@pytest.mark.slow
def test_a_long_one_line_document_is_preprocessed_in_bounded_memory(tmp_path, hf_tokenizer_file):
    """A 4 MB one-line document: the tool's peak memory stays under 768 MiB (355 MiB here, most of it the imports;
    encoding the document whole peaks at 1.1 GiB, at 16 MB at 4 GiB, where the tool takes 506 MiB)."""
    words = natural_text().split()
    line = " ".join(words[i % len(words)] for i in range(800_000))[:4 << 20]
    (tmp_path / "big.jsonl").write_text(json.dumps({"text": line}) + "\n")
    # VmHWM, the peak of this process image: ru_maxrss would count the (large) pytest process it was forked from
    code = ("import re, sys; from tools.preprocess_data import main; main(sys.argv[1:]); "
            "print(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1])")
    result = subprocess.run([sys.executable, "-c", code, "--input", str(tmp_path / "big.jsonl"), "--output-prefix",
                             str(tmp_path / "big"), "--tokenizer-type", "HFTokenizer", "--vocab-file",
                             hf_tokenizer_file, "--append-eod", "--workers", "1"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    peak_kib = int(result.stdout.split()[-1])
    assert peak_kib < 768 << 10, f"peak {peak_kib / 1024:.0f} MiB"
    assert len(MMapIndexedDataset(str(tmp_path / "big_text_document"))) == 1
