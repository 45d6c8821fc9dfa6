"""A synthetic corpus whose best loss needs capacity: an order-2 Markov source with a random successor table.

    python data_prep/markov_corpus.py --out data/markov [--vocab 64] [--tokens 12000000] [--seed 0]

Every context (the two tokens before) has SUCCESSORS next tokens drawn at random from the vocabulary, with the
fixed probabilities PROBABILITIES. Nothing in the table is shared between contexts, so a model lowers its loss
only by storing more of it: the source's entropy rate (written to OUT/markov_source.json) is the loss of a model
that stored all of it, ln(vocab) that of one that stored nothing, and how far between a model ends says how much
it holds. This is the regime the growth study needs: the part of language modelling that scales with
parameters (memorising associations: n-grams, names, facts) without the part a small model learns as well as a
large one. With the default 64 tokens the table has 4,096 contexts (about 95k bits).

Documents are DOCUMENT_TOKENS tokens, each started from two uniform tokens and ended with `<|endoftext|>`.
Writes OUT/tokenizer.json (a word-level tokenizer: tokens "t0".."t{vocab-1}" and `<|endoftext|>`),
OUT/markov_text_document.bin/.idx and OUT/markov_source.json. The same arguments write the same bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from megatron.cli import one_line_errors
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, data_file_path, index_file_path
from megatron.data.preprocess import output_prefix_for
from megatron.tokenizer.hf_tokenizer import EOD_TOKEN

NAME = "markov"
PROBABILITIES = (0.55, 0.25, 0.12, 0.08)
SUCCESSORS = len(PROBABILITIES)
DOCUMENT_TOKENS = 2048
DOCUMENTS_AT_ONCE = 512
MAX_VOCAB = 256  # the table is drawn as a vocab² × vocab matrix  # generated side by side: one numpy step per position


def successor_table(vocab: int, seed: int) -> np.ndarray:
    """[vocab², SUCCESSORS] distinct next tokens of each context (previous · vocab + last), most likely first."""
    rng = np.random.default_rng([seed, 0])
    return np.argsort(rng.random((vocab * vocab, vocab)), axis=1)[:, :SUCCESSORS].astype(np.int64)


def entropy_rate() -> float:
    """Nats per token of the source: the loss of a model that holds the whole table."""
    return -sum(p * math.log(p) for p in PROBABILITIES)


def documents(table: np.ndarray, vocab: int, count: int, seed: int, first: int) -> np.ndarray:
    """[count, DOCUMENT_TOKENS] token ids of documents first, first + 1, ...: each a walk of the source from two
    uniform tokens."""
    rng = np.random.default_rng([seed, 1, first])
    walks = np.empty((count, DOCUMENT_TOKENS), dtype=np.int64)
    walks[:, :2] = rng.integers(0, vocab, (count, 2))
    picks = rng.choice(SUCCESSORS, size=(count, DOCUMENT_TOKENS), p=PROBABILITIES)
    for t in range(2, DOCUMENT_TOKENS):
        walks[:, t] = table[walks[:, t - 2] * vocab + walks[:, t - 1], picks[:, t]]
    return walks


def write_tokenizer(path: Path, vocab: int) -> None:
    words = {f"t{i}": i for i in range(vocab)} | {EOD_TOKEN: vocab}
    tokenizer = Tokenizer(WordLevel(words, unk_token=EOD_TOKEN))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(path))


def build(out: Path, vocab: int, tokens: int, seed: int) -> str:
    """Write the tokenizer, the dataset and the source's description; returns the dataset prefix."""
    out.mkdir(parents=True, exist_ok=True)
    table = successor_table(vocab, seed)
    prefix = output_prefix_for(str(out / NAME), "text")
    builder = MMapIndexedDatasetBuilder(data_file_path(prefix), dtype=np.uint16)
    count = math.ceil(tokens / (DOCUMENT_TOKENS + 1))
    for first in range(0, count, DOCUMENTS_AT_ONCE):
        block = documents(table, vocab, min(DOCUMENTS_AT_ONCE, count - first), seed, first)
        with_eod = np.concatenate([block, np.full((len(block), 1), vocab)], axis=1)
        builder.add_documents(with_eod.reshape(-1), np.full(len(block), DOCUMENT_TOKENS + 1))
    builder.finalize(index_file_path(prefix))
    write_tokenizer(out / "tokenizer.json", vocab)
    source = {"vocab": vocab, "order": 2, "successor_probabilities": list(PROBABILITIES), "seed": seed,
              "documents": count, "document_tokens": DOCUMENT_TOKENS, "entropy_rate_nats": entropy_rate(),
              "uniform_nats": math.log(vocab)}
    (out / f"{NAME}_source.json").write_text(json.dumps(source, indent=1) + "\n", encoding="utf-8")
    return prefix


@one_line_errors("markov_corpus.py")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--vocab", type=int, default=64, help=f"distinct tokens, {SUCCESSORS} to {MAX_VOCAB}")
    parser.add_argument("--tokens", type=int, default=12_000_000, help="about this many tokens in all")
    parser.add_argument("--seed", type=int, default=0, help="picks the table and the walks")
    args = parser.parse_args(argv)
    if not SUCCESSORS <= args.vocab <= MAX_VOCAB:
        parser.error(f"--vocab {args.vocab}: give {SUCCESSORS} to {MAX_VOCAB} (each context needs {SUCCESSORS} "
                     "distinct successors; the table has vocab² rows)")
    if args.tokens < DOCUMENT_TOKENS:
        parser.error(f"--tokens {args.tokens}: give at least one document, {DOCUMENT_TOKENS} tokens")
    prefix = build(args.out, args.vocab, args.tokens, args.seed)
    print(f"{prefix}: entropy rate {entropy_rate():.4f} nats per token (uniform: {math.log(args.vocab):.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
