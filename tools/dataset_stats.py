"""Print what an indexed dataset holds: documents, tokens, a length histogram and a decoded sample.

    python tools/dataset_stats.py data/pile_text_document --tokenizer-type HFTokenizer \\
        --vocab-file data/20B_tokenizer.json --sample 3

Without a tokenizer the sample is shown as token ids. Opening the dataset
also validates it (sizes against the .bin length, monotone pointers).
"""

import argparse
import sys

import numpy as np

# Run as `python tools/dataset_stats.py` from anywhere: make the repository's `megatron` importable.
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.tokenizer import SUPPORTED_TOKENIZER_TYPES, build_tokenizer

_HISTOGRAM_WIDTH = 40
_CHUNK = 1 << 24


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prefix", help="data prefix (the path without .bin/.idx)")
    parser.add_argument("--tokenizer-type", choices=SUPPORTED_TOKENIZER_TYPES, help="decode the sample with this")
    parser.add_argument("--vocab-file")
    parser.add_argument("--merge-file")
    parser.add_argument("--sample", type=int, default=0, help="index of the document to show")
    parser.add_argument("--sample-tokens", type=int, default=200, help="show at most this many of its tokens")
    return parser.parse_args(argv)


def length_histogram(sizes: np.ndarray) -> list[tuple[int, int, int]]:
    """(low, high, count) per power-of-two length bucket [low, high), counted in bounded-memory chunks."""
    counts = np.zeros(33, dtype=np.int64)
    for start in range(0, len(sizes), _CHUNK):
        chunk = np.asarray(sizes[start : start + _CHUNK], dtype=np.int64)
        buckets = np.where(chunk > 0, np.floor(np.log2(np.maximum(chunk, 1))).astype(np.int64) + 1, 0)
        counts += np.bincount(buckets, minlength=33)
    return [(0 if b == 0 else 1 << (b - 1), 1 if b == 0 else 1 << b, int(c)) for b, c in enumerate(counts) if c]


def describe(dataset: MMapIndexedDataset) -> list[str]:
    sizes = dataset.sizes
    tokens = int(np.sum(sizes, dtype=np.int64))
    lines = [
        f"{dataset.prefix}: {max(len(dataset.doc_idx) - 1, 0)} documents, {len(dataset)} sequences, {tokens} tokens "
        f"({dataset.dtype.name})",
    ]
    if len(dataset):
        lines.append(
            f"tokens per sequence: mean {tokens / len(dataset):.1f}, median {int(np.median(sizes))}, "
            f"min {int(sizes.min())}, max {int(sizes.max())}"
        )
        histogram = length_histogram(sizes)
        peak = max(count for _, _, count in histogram)
        for low, high, count in histogram:
            bar = "#" * max(1, round(_HISTOGRAM_WIDTH * count / peak))
            lines.append(f"  [{low:>9}, {high:>9}) {count:>12}  {bar}")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        dataset = MMapIndexedDataset(args.prefix)
        tokenizer = None
        if args.tokenizer_type:
            tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file)
        if len(dataset) and not 0 <= args.sample < len(dataset):
            raise ValueError(f"--sample {args.sample} is not a sequence index of {args.prefix} (0..{len(dataset) - 1})")
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print("\n".join(describe(dataset)))
    if len(dataset):
        ids = dataset.get(args.sample, 0, min(args.sample_tokens, int(dataset.sizes[args.sample])))
        shown = repr(tokenizer.detokenize(ids)) if tokenizer else ids.tolist()
        print(f"sequence {args.sample}, first {len(ids)} tokens: {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
