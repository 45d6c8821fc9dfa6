"""tools/preprocess_data.py and its module: order, skipped lines, exact tokens, atomic outputs."""

import gzip
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.preprocess import output_prefix_for, preprocess_jsonl
from megatron.tokenizer import build_tokenizer

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
    stats = preprocess_jsonl(
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
    stats = preprocess_jsonl([path], str(tmp_path / "out"), CHAR_LEVEL, workers=2, chunk_size=2, show_progress=False)
    expected = [list(b"good one"), list(b"good two"), list(b"good three")]
    assert documents_of(str(tmp_path / "out_text_document")) == expected
    assert stats.skipped == 7
    locations = [example.split(": ", 1)[0] for example in stats.skipped_examples]
    assert locations == [f"{path}:{n}" for n in (2, 3, 4, 5, 6, 7, 9)]
    reasons = " | ".join(stats.skipped_examples)
    for reason in ("invalid JSON", "'text' is int", "missing key 'text'", "blank line", "empty 'text'", "not a JSON"):
        assert reason in reasons


def load_demo_corpus_module():
    spec = importlib.util.spec_from_file_location("demo_corpus", os.path.join(REPO_ROOT, "data_prep", "demo_corpus.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hf_tokenizer_file(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf")
    texts = [f"sample sentence number {i}, with words." for i in range(50)]
    corpus = write_jsonl(directory / "c.jsonl", [{"text": text} for text in texts])
    load_demo_corpus_module().train_tokenizer(corpus, 320, str(directory / "tokenizer.json"))
    return str(directory / "tokenizer.json")


def test_output_equals_tokenizing_directly(tmp_path, hf_tokenizer_file):
    tokenizer = build_tokenizer("HFTokenizer", hf_tokenizer_file)
    texts = ["Hello there, sample sentence.", "Numbers 12345 and ünïcode ✓", "words words words"]
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    preprocess_jsonl([path], str(tmp_path / "out"), tokenizer, append_eod=True, show_progress=False)
    dataset = MMapIndexedDataset(str(tmp_path / "out_text_document"))
    assert dataset.dtype == np.uint16
    assert [dataset[i].tolist() for i in range(3)] == [tokenizer.tokenize(t) + [tokenizer.eod] for t in texts]
    assert tokenizer.detokenize(dataset[1]) == texts[1]


def test_one_dataset_per_key_and_lines_missing_a_key_skipped_for_all(tmp_path):
    path = write_jsonl(
        tmp_path / "in.jsonl", [{"title": "A", "text": "alpha"}, {"text": "no title"}, {"title": "C", "text": "gamma"}]
    )
    keys = ["text", "title"]
    stats = preprocess_jsonl([path], str(tmp_path / "out"), CHAR_LEVEL, jsonl_keys=keys, show_progress=False)
    assert documents_of(str(tmp_path / "out_text_document")) == [list(b"alpha"), list(b"gamma")]
    assert documents_of(str(tmp_path / "out_title_document")) == [list(b"A"), list(b"C")]
    assert stats.skipped_examples == [f"{path}:2: missing key 'title'"]


def test_failed_run_leaves_no_output(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": f"doc {i}"} for i in range(500)])
    corrupt = tmp_path / "corrupt.jsonl.gz"
    corrupt.write_bytes(b"this is not gzip data")
    out_dir = tmp_path / "out"
    with pytest.raises(OSError, match="cannot read input .*corrupt.jsonl.gz"):
        preprocess_jsonl(
            [good, str(corrupt)], str(out_dir / "x"), CHAR_LEVEL, workers=2, chunk_size=16, show_progress=False
        )
    assert os.listdir(out_dir) == []


def test_missing_input_is_named_before_any_work(tmp_path):
    with pytest.raises(FileNotFoundError, match="--input files not found: .*absent.jsonl"):
        preprocess_jsonl([str(tmp_path / "absent.jsonl")], str(tmp_path / "x"), CHAR_LEVEL, show_progress=False)


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
