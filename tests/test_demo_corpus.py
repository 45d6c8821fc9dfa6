"""data_prep/demo_corpus.py: offline, deterministic, skips finished steps, and its outputs load."""

import hashlib
import json
import os
import subprocess
import sys

import pytest

from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.tokenizer import build_tokenizer

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTPUTS = ("corpus.jsonl", "tokenizer.json", "demo_text_document.bin", "demo_text_document.idx")


def run_builder(out, *extra):
    result = subprocess.run(
        [sys.executable, "data_prep/demo_corpus.py", "--out", str(out), "--max-docs", "40", "--vocab-size", "400"]
        + list(extra),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def digests(out):
    return {name: hashlib.sha256((out / name).read_bytes()).hexdigest() for name in OUTPUTS}


@pytest.fixture(scope="module")
def small_build(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    return out, run_builder(out)


def test_small_build_outputs_load_and_agree(small_build):
    out, stdout = small_build
    assert "40 documents" in stdout
    with open(out / "corpus.jsonl", encoding="utf-8") as stream:
        texts = [json.loads(line)["text"] for line in stream]
    assert len(texts) == 40 and len(set(texts)) == 40 and all(texts)
    tokenizer = build_tokenizer("HFTokenizer", str(out / "tokenizer.json"))
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.pad) == (400, 0, 1)
    dataset = MMapIndexedDataset(str(out / "demo_text_document"))
    assert len(dataset) == 40
    for index in (0, 17, 39):
        assert dataset[index][-1] == tokenizer.eod
        assert tokenizer.detokenize(dataset[index]) == texts[index]


def modification_times(out):
    return {name: os.stat(out / name).st_mtime_ns for name in OUTPUTS}


def test_rerun_skips_and_force_rebuilds_identically(small_build):
    out, _ = small_build
    before, stamps = digests(out), modification_times(out)
    assert "up to date" in run_builder(out)
    assert modification_times(out) == stamps
    os.remove(out / "demo_text_document.idx")
    assert "up to date" not in run_builder(out)
    assert modification_times(out)["tokenizer.json"] == stamps["tokenizer.json"]
    run_builder(out, "--force")
    rebuilt = modification_times(out)
    assert all(rebuilt[name] != stamps[name] for name in OUTPUTS)
    assert digests(out) == before


def test_full_corpus_size_is_in_the_demo_range():
    script = (
        "import importlib.util, sys; "
        "spec = importlib.util.spec_from_file_location('d', 'data_prep/demo_corpus.py'); "
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
        "docs = m.collect_documents(); print(len(docs), sum(len(d.encode()) for d in docs))"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    count, size = map(int, result.stdout.split())
    assert count > 1000 and 1_000_000 < size < 3_000_000
