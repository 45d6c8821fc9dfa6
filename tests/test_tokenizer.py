"""Tokenizers: HF tokenizer.json round trips and GPT-NeoX special-token conventions, char level, vocab padding."""

import pickle

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from megatron.tokenizer import build_tokenizer, pad_vocab_size

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
    with pytest.raises(ValueError, match="HFTokenizer, CharLevelTokenizer.*GPT2BPETokenizer and SPMTokenizer"):
        build_tokenizer("GPT2BPETokenizer")


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
