"""Train a tokenizer on .jsonl(.gz/.zst) or .txt files: byte-level BPE or SentencePiece (unigram or BPE).

    python tools/train_tokenizer.py --input 'corpus/*.jsonl.zst' --kind bpe --vocab-size 50000 \\
        --output data/tokenizer.json            # then: tokenizer_type HFTokenizer, vocab_file data/tokenizer.json
    python tools/train_tokenizer.py --input corpus.txt --txt-documents line --kind spm-unigram \\
        --vocab-size 32000 --output data/spm.model   # then: tokenizer_type SPMTokenizer, vocab_file data/spm.model

Both kinds round-trip any text exactly and carry <|endoftext|> (eod) and
<|padding|> (pad). Unusable lines are skipped and counted; --max-documents
trains on the first N documents only (tokenizers rarely need the whole corpus).
"""

import argparse
import itertools
import os
import sys
from collections import Counter
from collections.abc import Iterator

# Run as `python tools/train_tokenizer.py` from anywhere: make the repository's `megatron` importable.
from megatron.data.corpus_reader import TXT_DOCUMENT_MODES, CorpusReader, expand_inputs, parse_record
from megatron.tokenizer import build_tokenizer
from megatron.tokenizer.train import minimum_vocab_size, train_byte_level_bpe, train_sentencepiece

KINDS = {"bpe": "HFTokenizer", "spm-unigram": "SPMTokenizer", "spm-bpe": "SPMTokenizer"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="comma-separated files or glob patterns")
    parser.add_argument("--jsonl-key", default="text", help="JSON key holding the text")
    parser.add_argument("--txt-documents", choices=TXT_DOCUMENT_MODES, default="file")
    parser.add_argument("--kind", choices=sorted(KINDS), default="bpe")
    parser.add_argument("--vocab-size", type=int, required=True, help="vocabulary size, special tokens included")
    parser.add_argument("--output", required=True, help="tokenizer.json (bpe) or .model file (spm-*)")
    parser.add_argument("--max-documents", type=int, help="train on the first N usable documents")
    args = parser.parse_args(argv)
    minimum = minimum_vocab_size("bpe" if args.kind == "bpe" else "sentencepiece")
    if args.vocab_size < minimum:
        parser.error(f"--vocab-size must be at least {minimum} for --kind {args.kind}")
    if args.max_documents is not None and args.max_documents < 1:
        parser.error("--max-documents must be at least 1")
    return args


def _documents(reader: CorpusReader, key: str, skipped: Counter) -> Iterator[str]:
    for record in reader:
        texts, reason = parse_record(record, [key])
        if texts is None:
            skipped[reason.split(" (")[0]] += 1
        else:
            yield texts[key]


def main(argv=None) -> int:
    args = parse_args(argv)
    skipped: Counter = Counter()
    try:
        inputs = expand_inputs([pattern.strip() for pattern in args.input.split(",") if pattern.strip()])
        reader = CorpusReader(inputs, args.txt_documents)
        documents = itertools.islice(_documents(reader, args.jsonl_key, skipped), args.max_documents)
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        if args.kind == "bpe":
            train_byte_level_bpe(documents, args.vocab_size, args.output)
        else:
            train_sentencepiece(documents, args.vocab_size, args.kind.removeprefix("spm-"), args.output)
        tokenizer = build_tokenizer(KINDS[args.kind], args.output)
    except (OSError, ValueError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    reasons = ", ".join(f"{count} {reason}" for reason, count in skipped.most_common())
    print(
        f"done: {args.output} ({KINDS[args.kind]}), vocabulary {tokenizer.vocab_size}, eod {tokenizer.eod}, "
        f"pad {tokenizer.pad}; {sum(skipped.values())} lines skipped" + (f" ({reasons})" if reasons else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
