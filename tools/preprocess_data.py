"""Tokenize .jsonl / .jsonl.gz corpora into mmap indexed datasets (GPT-NeoX flags and output naming).

Example:
    python tools/preprocess_data.py --input data/corpus.jsonl --output-prefix data/mydata \\
        --tokenizer-type HFTokenizer --vocab-file data/tokenizer.json --append-eod --workers 2
writes data/mydata_text_document.bin/.idx; train with data_path data/mydata_text_document.
"""

import argparse
import os
import sys

# Run as `python tools/preprocess_data.py` from anywhere: make the repository's `megatron` importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.data.preprocess import output_prefix_for, preprocess_jsonl  # noqa: E402
from megatron.tokenizer import SUPPORTED_TOKENIZER_TYPES, build_tokenizer  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="comma-separated list of .jsonl or .jsonl.gz files")
    parser.add_argument("--jsonl-keys", nargs="+", default=["text"], help="JSON keys to tokenize, one dataset each")
    parser.add_argument("--output-prefix", required=True, help="outputs are {prefix}_{key}_document.bin/.idx")
    parser.add_argument("--tokenizer-type", required=True, choices=SUPPORTED_TOKENIZER_TYPES)
    parser.add_argument("--vocab-file", help="tokenizer.json for HFTokenizer")
    parser.add_argument("--merge-file", help="BPE merges file (for the BPE tokenizer types)")
    parser.add_argument("--append-eod", action="store_true", help="end every document with the eod token")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    parser.add_argument("--log-interval", type=int, default=100, help="input lines between progress updates")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    inputs = [path.strip() for path in args.input.split(",") if path.strip()]
    try:
        tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file)
        stats = preprocess_jsonl(
            inputs,
            args.output_prefix,
            tokenizer,
            jsonl_keys=args.jsonl_keys,
            append_eod=args.append_eod,
            workers=args.workers,
            log_interval=args.log_interval,
        )
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
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
