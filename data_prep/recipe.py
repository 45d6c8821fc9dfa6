"""What the corpus recipes share: tokenizer flags, running the preprocessor, and the config snippet they write."""

import argparse
import os

# Recipes run as `python data_prep/NAME.py`: make the repository's `megatron` importable.
from megatron.data.preprocess import output_prefix_for, preprocess_corpus
from megatron.tokenizer import SUPPORTED_TOKENIZER_TYPES, AbstractTokenizer, build_tokenizer


def add_tokenizer_arguments(parser: argparse.ArgumentParser, default_type: str = "HFTokenizer") -> None:
    parser.add_argument("--tokenizer-type", choices=SUPPORTED_TOKENIZER_TYPES, default=default_type)
    parser.add_argument("--vocab-file", help="e.g. GPT-NeoX-20B's 20B_tokenizer.json for HFTokenizer")
    parser.add_argument("--merge-file", help="merges.txt for GPT2BPETokenizer")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    parser.add_argument("--no-progress", action="store_true")


def tokenizer_from(args: argparse.Namespace) -> AbstractTokenizer:
    return build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file)


def tokenize_split(
    inputs: list[str], out_dir: str, name: str, tokenizer: AbstractTokenizer, args: argparse.Namespace
) -> str:
    """Tokenize ``inputs`` into ``{out_dir}/{name}_text_document``; prints the summary and returns the prefix."""
    stats = preprocess_corpus(
        inputs, os.path.join(out_dir, name), tokenizer, append_eod=True, workers=args.workers,
        show_progress=not args.no_progress,
    )
    prefix = output_prefix_for(os.path.join(out_dir, name), "text")
    print(f"{prefix}: {stats.summary()}")
    for example in stats.skipped_examples[:10]:
        print(f"  skipped {example}")
    return prefix


def write_config_snippet(out_dir: str, name: str, settings: dict[str, object], args: argparse.Namespace) -> str:
    """A YAML file with the data keys to train on what was built; printed as well."""
    lines = [f"# Data built by data_prep ({name}); add to your training config.\n"]
    for key, value in settings.items():
        if isinstance(value, list):
            lines.append(f"{key}:\n" + "".join(f"  - {item}\n" for item in value))
        else:
            lines.append(f"{key}: {value}\n")
    lines.append(f"tokenizer_type: {args.tokenizer_type}\n")
    for key in ("vocab_file", "merge_file"):
        if getattr(args, key, None):
            lines.append(f"{key}: {os.path.abspath(getattr(args, key))}\n")
    path = os.path.join(out_dir, f"{name}_data.yml")
    with open(path, "w", encoding="utf-8") as stream:
        stream.writelines(lines)
    print(f"config snippet {path}:\n" + "".join(lines))
    return path
