"""The Pile, from a local copy, into train/valid/test datasets.

    python data_prep/pile.py --input /data/pile --out data/pile \\
        --tokenizer-type HFTokenizer --vocab-file data/20B_tokenizer.json --workers 16

--input is the Pile's directory: train/00.jsonl.zst ... train/29.jsonl.zst,
val.jsonl.zst and test.jsonl.zst. Nothing is downloaded. What to expect with
the GPT-NeoX-20B tokenizer: about 210M training documents and 300B tokens, a
~600 GB pile_train_text_document.bin (uint16) with a ~4.2 GB .idx. Preprocessing
throughput per worker: benchmarks/RESULTS.md, "Data pipeline".

With --deduplicated, --input is a directory of the deduplicated Pile's
.jsonl.zst (or .jsonl) shards, any number of them, used for training only
(~134M documents, ~207B tokens); validation and test come from --eval-input
(the Pile's val/test files) if given.

Writes pile_data.yml with train/valid/test_data_paths to add to the training config.
"""

import argparse
import glob
import os
import sys

from recipe import add_tokenizer_arguments, tokenize_split, tokenizer_from, write_config_snippet

TRAIN_SHARDS = [os.path.join("train", f"{shard:02d}.jsonl.zst") for shard in range(30)]
EVAL_FILES = {"valid": "val.jsonl.zst", "test": "test.jsonl.zst"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="the Pile's directory (see above)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--deduplicated", action="store_true", help="--input holds the deduplicated Pile's shards")
    parser.add_argument("--eval-input", help="with --deduplicated: the directory holding val.jsonl.zst/test.jsonl.zst")
    add_tokenizer_arguments(parser)
    return parser.parse_args(argv)


def _inputs(args: argparse.Namespace) -> dict[str, list[str]]:
    """Split name -> input files; an error lists every expected file that is missing."""
    if args.deduplicated:
        shards = [os.path.join(args.input, pattern) for pattern in ("*.jsonl.zst", "*.jsonl")]
        train = sorted(path for pattern in shards for path in glob.glob(pattern))
        if not train:
            raise FileNotFoundError(f"--input {args.input} holds no .jsonl.zst or .jsonl shards of the dedup Pile")
        splits, eval_dir = {"train": train}, args.eval_input
    else:
        splits, eval_dir = {"train": [os.path.join(args.input, shard) for shard in TRAIN_SHARDS]}, args.input
    if eval_dir:
        splits.update({name: [os.path.join(eval_dir, file)] for name, file in EVAL_FILES.items()})
    missing = [path for paths in splits.values() for path in paths if not os.path.isfile(path)]
    if missing:
        raise FileNotFoundError(
            f"the Pile is incomplete under {args.input}: missing {', '.join(missing)} "
            f"(expected train/00.jsonl.zst .. train/29.jsonl.zst, val.jsonl.zst, test.jsonl.zst)"
        )
    return splits


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        splits = _inputs(args)
        tokenizer = tokenizer_from(args)
        prefixes = {
            name: tokenize_split(paths, args.out, f"pile_{name}", tokenizer, args) for name, paths in splits.items()
        }
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    write_config_snippet(args.out, "pile", {f"{name}_data_paths": [prefix] for name, prefix in prefixes.items()}, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
