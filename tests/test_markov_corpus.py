"""data_prep/markov_corpus.py: the growth study's synthetic source is what its description says, reproducible, and
readable by the trainer's tokenizer and dataset."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.tokenizer.hf_tokenizer import HFTokenizer
from tests.conftest import REPO

# Loaded from its file, as the other data_prep scripts are (tests/test_demo_corpus.py): data_prep is no package.
_SPEC = importlib.util.spec_from_file_location("markov_corpus", REPO / "data_prep" / "markov_corpus.py")
markov_corpus = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(markov_corpus)

VOCAB = 8


def build(out, *args):
    return subprocess.run([sys.executable, "data_prep/markov_corpus.py", "--out", str(out), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("markov")
    result = build(out, "--vocab", str(VOCAB), "--tokens", "300000", "--seed", "5")
    assert result.returncode == 0, result.stderr
    return out


def test_every_next_token_follows_the_table_with_its_probabilities(corpus):
    table = markov_corpus.successor_table(VOCAB, 5)
    dataset = MMapIndexedDataset(str(corpus / "markov_text_document"))
    ranks = Counter()
    for index in range(len(dataset)):
        document = dataset[index].astype(np.int64)
        assert len(document) == markov_corpus.DOCUMENT_TOKENS + 1 and document[-1] == VOCAB  # ends with <eod>
        walk = document[:-1]
        contexts = walk[:-2] * VOCAB + walk[1:-1]
        matches = table[contexts] == walk[2:, None]
        assert matches.sum(axis=1).tolist() == [1] * len(contexts)  # always one of the context's successors
        ranks.update(matches.argmax(axis=1).tolist())
    total = sum(ranks.values())
    observed = [ranks[rank] / total for rank in range(markov_corpus.SUCCESSORS)]
    assert observed == pytest.approx(markov_corpus.PROBABILITIES, abs=0.005)


def test_the_table_gives_each_context_distinct_successors():
    table = markov_corpus.successor_table(VOCAB, 5)
    assert table.shape == (VOCAB * VOCAB, markov_corpus.SUCCESSORS)
    assert all(len(set(row)) == markov_corpus.SUCCESSORS for row in table.tolist())
    assert not np.array_equal(table, markov_corpus.successor_table(VOCAB, 6))


def test_description_and_tokenizer_match_the_data(corpus):
    source = json.loads((corpus / "markov_source.json").read_text())
    probabilities = markov_corpus.PROBABILITIES
    assert source["entropy_rate_nats"] == pytest.approx(-sum(p * math.log(p) for p in probabilities))
    assert source["uniform_nats"] == pytest.approx(math.log(VOCAB)) and source["vocab"] == VOCAB
    tokenizer = HFTokenizer(str(corpus / "tokenizer.json"))
    assert tokenizer.vocab_size == VOCAB + 1 and tokenizer.eod == VOCAB
    assert tokenizer.tokenize("t3 t0 t7") == [3, 0, 7] and tokenizer.detokenize([3, 0]) == "t3 t0"


def test_same_arguments_write_the_same_bytes(corpus, tmp_path):
    assert build(tmp_path, "--vocab", str(VOCAB), "--tokens", "300000", "--seed", "5").returncode == 0
    for name in ("markov_text_document.bin", "markov_text_document.idx", "tokenizer.json"):
        assert (tmp_path / name).read_bytes() == (corpus / name).read_bytes()


@pytest.mark.parametrize(("args", "message"), [(["--vocab", "3"], "--vocab 3: give 4 to 256"),
                                               (["--vocab", "300"], "--vocab 300"),
                                               (["--tokens", "10"], "--tokens 10: give at least one document")])
def test_bad_arguments_are_one_clear_error(tmp_path, args, message):
    result = build(tmp_path / "out", *args)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()
