"""Tokenizers: HF tokenizer.json, GPT-2 BPE, SentencePiece, char level; special ids, vocab padding, training."""

import gzip
import json
import os
import pickle
import subprocess
import sys

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from megatron.tokenizer import build_tokenizer, pad_vocab_size
from megatron.tokenizer.train import train_sentencepiece

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Tokenizers split text into pieces; the pieces map to ids.",
    "Ünïcödé ✓ and emoji 🙂 survive a byte-level round trip.",
    "def add(a, b):\n    return a + b\n",
]


def train_tokenizer(path, special_tokens):
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TEXTS * 5, trainer)
    tokenizer.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def neox_style(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json", ["<|endoftext|>", "<|padding|>"])


def test_hf_round_trip_and_special_ids(neox_style):
    tokenizer = build_tokenizer("HFTokenizer", vocab_file=neox_style)
    assert (tokenizer.eod, tokenizer.pad) == (0, 1)
    assert tokenizer.vocab_size == Tokenizer.from_file(neox_style).get_vocab_size()
    for text in TEXTS + ["unseen words: zyzzyva, qwxj"]:
        ids = tokenizer.tokenize(text)
        assert all(0 <= i < tokenizer.vocab_size for i in ids)
        assert tokenizer.detokenize(ids) == text
    assert tokenizer.detokenize([tokenizer.eod] + tokenizer.tokenize("end") + [tokenizer.pad]) == "end"


def test_hf_batch_matches_single(neox_style):
    tokenizer = build_tokenizer("HFTokenizer", vocab_file=neox_style)
    assert tokenizer.tokenize_batch(TEXTS) == [tokenizer.tokenize(text) for text in TEXTS]
    clone = pickle.loads(pickle.dumps(tokenizer))
    assert clone.tokenize(TEXTS[0]) == tokenizer.tokenize(TEXTS[0])


def test_pad_falls_back_to_eod(tmp_path):
    tokenizer = build_tokenizer("HFTokenizer", train_tokenizer(tmp_path / "t.json", ["<|endoftext|>"]))
    assert tokenizer.pad == tokenizer.eod == 0


def test_tokenizer_without_eod_is_rejected(tmp_path):
    path = train_tokenizer(tmp_path / "t.json", ["<unk>"])
    with pytest.raises(ValueError, match=r"t\.json has no <\|endoftext\|> token"):
        build_tokenizer("HFTokenizer", path)


def test_missing_or_invalid_vocab_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="vocab_file .*nope.json not found"):
        build_tokenizer("HFTokenizer", str(tmp_path / "nope.json"))
    with pytest.raises(ValueError, match="needs vocab_file"):
        build_tokenizer("HFTokenizer")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="broken.json is not a valid tokenizer.json"):
        build_tokenizer("HFTokenizer", str(broken))


def test_unknown_type_lists_supported():
    with pytest.raises(ValueError, match="HFTokenizer, GPT2BPETokenizer, SPMTokenizer, CharLevelTokenizer"):
        build_tokenizer("WordPiece")


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory, neox_style):
    """GPT-2's file layout (vocab.json + merges.txt) of the BPE trained above."""
    directory = tmp_path_factory.mktemp("gpt2")
    vocab, merges = Tokenizer.from_file(neox_style).model.save(str(directory))
    return vocab, merges


def test_gpt2_bpe_matches_the_same_model_as_tokenizer_json(gpt2_files, neox_style):
    tokenizer = build_tokenizer("GPT2BPETokenizer", *gpt2_files)
    reference = Tokenizer.from_file(neox_style)
    assert tokenizer.vocab_size == reference.get_vocab_size()
    assert tokenizer.eod == tokenizer.pad == reference.token_to_id("<|endoftext|>")
    for text in TEXTS + ["unseen words: zyzzyva, qwxj"]:
        assert tokenizer.tokenize(text) == reference.encode(text).ids
        assert tokenizer.detokenize(tokenizer.tokenize(text) + [tokenizer.eod]) == text
    assert tokenizer.tokenize_batch(TEXTS) == [tokenizer.tokenize(t) for t in TEXTS]
    clone = pickle.loads(pickle.dumps(tokenizer))
    assert clone.tokenize(TEXTS[2]) == tokenizer.tokenize(TEXTS[2])


def test_gpt2_bpe_needs_both_files_and_an_eod(tmp_path, gpt2_files):
    with pytest.raises(ValueError, match="needs merge_file: the path of GPT-2's merges.txt"):
        build_tokenizer("GPT2BPETokenizer", gpt2_files[0])
    with pytest.raises(FileNotFoundError, match="merge_file .*nope.txt not found"):
        build_tokenizer("GPT2BPETokenizer", gpt2_files[0], str(tmp_path / "nope.txt"))
    no_eod = tmp_path / "vocab.json"
    no_eod.write_text(json.dumps({"a": 0, "b": 1, "ab": 2}))
    merges = tmp_path / "merges.txt"
    merges.write_text("#version: 0.2\na b\n")
    with pytest.raises(ValueError, match="vocab.json has no <\\|endoftext\\|> entry"):
        build_tokenizer("GPT2BPETokenizer", str(no_eod), str(merges))


@pytest.fixture(scope="module", params=["unigram", "bpe"])
def spm_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("spm") / f"{request.param}.model"
    train_sentencepiece(TEXTS * 20, 320, request.param, str(path))
    return str(path)


def test_spm_round_trip_and_special_ids(spm_model):
    tokenizer = build_tokenizer("SPMTokenizer", spm_model)
    assert tokenizer.eod == 2 and tokenizer.pad == 3
    for text in TEXTS + ["  leading spaces, tabs\tand unseen ß∂ƒ characters\n"]:
        ids = tokenizer.tokenize(text)
        assert all(0 <= i < tokenizer.vocab_size for i in ids)
        assert tokenizer.detokenize(ids + [tokenizer.eod, tokenizer.pad]) == text
    assert tokenizer.tokenize_batch(TEXTS) == [tokenizer.tokenize(t) for t in TEXTS]
    assert pickle.loads(pickle.dumps(tokenizer)).tokenize(TEXTS[0]) == tokenizer.tokenize(TEXTS[0])
    with pytest.raises(ValueError, match="SPMTokenizer ids lie in"):
        tokenizer.detokenize([tokenizer.vocab_size])


def test_spm_rejects_non_models(tmp_path):
    bogus = tmp_path / "bogus.model"
    bogus.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="bogus.model is not a SentencePiece model"):
        build_tokenizer("SPMTokenizer", str(bogus))


def run_train_tool(*args):
    return subprocess.run(
        [sys.executable, "tools/train_tokenizer.py", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "kind, tokenizer_type, output", [("bpe", "HFTokenizer", "t.json"), ("spm-bpe", "SPMTokenizer", "t.model")]
)
def test_train_tokenizer_tool(tmp_path, kind, tokenizer_type, output):
    corpus = tmp_path / "corpus.jsonl.gz"
    with gzip.open(corpus, "wt", encoding="utf-8") as stream:
        stream.writelines(json.dumps({"text": text}) + "\n" for text in TEXTS * 10)
        stream.write("{oops\n")
    result = run_train_tool(
        "--input", str(corpus), "--kind", kind, "--vocab-size", "400", "--output", str(tmp_path / output)
    )
    assert result.returncode == 0, result.stderr
    assert "1 lines skipped (1 invalid JSON)" in result.stdout
    tokenizer = build_tokenizer(tokenizer_type, str(tmp_path / output))
    assert tokenizer.detokenize(tokenizer.tokenize(TEXTS[2])) == TEXTS[2]
    missing = run_train_tool("--input", str(tmp_path / "none*.jsonl"), "--vocab-size", "300", "--output", "x")
    assert missing.returncode == 1 and "none*.jsonl" in missing.stderr


def test_char_level_round_trip():
    tokenizer = build_tokenizer("CharLevelTokenizer")
    assert tokenizer.vocab_size == 257 and tokenizer.eod == tokenizer.pad == 256
    for text in TEXTS:
        ids = tokenizer.tokenize(text)
        assert ids == list(text.encode("utf-8"))
        assert tokenizer.detokenize(ids + [tokenizer.eod]) == text
    assert tokenizer.tokenize_batch(TEXTS[:2]) == [tokenizer.tokenize(t) for t in TEXTS[:2]]
    with pytest.raises(ValueError, match="257"):
        tokenizer.detokenize([300])


@pytest.mark.parametrize(
    "vocab, divisible_by, model_parallel, expected",
    [(50277, 128, 1, 50304), (50277, 128, 2, 50432), (8192, 128, 4, 8192), (257, 8, 1, 264), (1, 1, 1, 1)],
)
def test_pad_vocab_size(vocab, divisible_by, model_parallel, expected):
    assert pad_vocab_size(vocab, divisible_by, model_parallel) == expected


def test_pad_vocab_size_rejects_non_positive():
    with pytest.raises(ValueError, match="must be positive"):
        pad_vocab_size(100, 0, 1)
