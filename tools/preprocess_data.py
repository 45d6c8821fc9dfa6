"""Tokenize corpora into mmap indexed datasets (GPT-NeoX flags and output naming).

Inputs: .jsonl / .json lines, optionally .gz or .zst compressed (the Pile's
shards are .jsonl.zst), and .txt files: one document per file, or per line
with --txt-documents line. --input takes a comma-separated list of files and
glob patterns, read in the order given (a pattern's matches sorted).

Example:
    python tools/preprocess_data.py --input 'pile/train/*.jsonl.zst' --output-prefix data/pile \\
        --tokenizer-type HFTokenizer --vocab-file data/20B_tokenizer.json --append-eod --workers 8
writes data/pile_text_document.bin/.idx (and .stats.json, its largest token id, which launches check against the
vocabulary); train with data_path data/pile_text_document. Outputs appear only when the whole run succeeded with at
least one document (inputs giving none are an error, and an older dataset at that prefix is kept); malformed lines
are skipped and listed by file:line.
"""

import argparse
import os
import signal
import sys

# Run as `python tools/preprocess_data.py` from anywhere: make the repository's `megatron` importable.
from megatron.cli import describe
from megatron.data.corpus_reader import TXT_DOCUMENT_MODES, expand_inputs
from megatron.data.preprocess import abort_in_progress, output_prefix_for, preprocess_corpus
from megatron.tokenizer import SUPPORTED_TOKENIZER_TYPES, build_tokenizer


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="comma-separated files or glob patterns")
    parser.add_argument("--jsonl-keys", nargs="+", default=["text"], help="JSON keys to tokenize, one dataset each")
    parser.add_argument("--output-prefix", required=True, help="outputs are {prefix}_{key}_document.bin/.idx")
    parser.add_argument("--tokenizer-type", required=True, choices=SUPPORTED_TOKENIZER_TYPES)
    parser.add_argument("--vocab-file", help="tokenizer.json (HF), vocab.json (GPT-2 BPE) or .model (SentencePiece)")
    parser.add_argument("--merge-file", help="merges.txt (GPT2BPETokenizer)")
    parser.add_argument("--append-eod", action="store_true", help="end every document with the eod token")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--log-interval", type=int, default=100, help="documents between progress updates")
    parser.add_argument(
        "--txt-documents", choices=TXT_DOCUMENT_MODES, default="file",
        help=".txt inputs: each file is one document, or each line is",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (logs, CI)")
    return parser.parse_args(argv)


def _abort(signum, frame) -> None:
    """Ctrl-C or a scheduler's kill: remove the partial outputs and stop the workers, then exit."""
    abort_in_progress()
    print("interrupted: no output written", file=sys.stderr, flush=True)
    os._exit(130)


def main(argv=None) -> int:
    args = parse_args(argv)
    for signal_number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signal_number, _abort)
    try:
        inputs = expand_inputs([pattern.strip() for pattern in args.input.split(",") if pattern.strip()])
        tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file)
        stats = preprocess_corpus(
            inputs,
            args.output_prefix,
            tokenizer,
            jsonl_keys=args.jsonl_keys,
            append_eod=args.append_eod,
            workers=args.workers,
            log_interval=args.log_interval,
            txt_documents=args.txt_documents,
            show_progress=not args.no_progress,
        )
    except (OSError, ValueError) as error:
        print(f"error: {describe(error)}", file=sys.stderr)
        return 1
    for example in stats.skipped_examples:
        print(f"skipped {example}", file=sys.stderr)
    if stats.skipped > len(stats.skipped_examples):
        print(f"... and {stats.skipped - len(stats.skipped_examples)} more skipped lines", file=sys.stderr)
    outputs = ", ".join(output_prefix_for(args.output_prefix, key) for key in args.jsonl_keys)
    print(f"done: {stats.summary()} -> {outputs}.bin/.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
