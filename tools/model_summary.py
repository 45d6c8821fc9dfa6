"""Print a TokenFormer's parameter counts by component and its training FLOPs per token.

    python tools/model_summary.py configs/150M.yml [more.yml ...] [--vocab-size N] [--json]

Later config files override earlier ones. The model is built on the meta device, so even the largest
configs take no memory. Configs normally leave padded_vocab_size unset (the tokenizer sets it when a run
starts); the default here is GPT-NeoX-20B's 50277 tokens padded to a multiple of 128.
"""

import argparse
import contextlib
import json
import sys
from collections.abc import Sequence

from megatron.config import load_config
from megatron.model import TokenFormerArgs, TokenFormerModel, flops_per_token
from megatron.model.parameter_count import count_parameters_by_component

DEFAULT_PADDED_VOCAB_SIZE = 50304


def summarize(args: TokenFormerArgs) -> dict[str, int]:
    """Parameter counts by component, `total_params`, and training FLOPs per token (with recompute
    exactly when the config checkpoints activations)."""
    summary = count_parameters_by_component(TokenFormerModel(args, device="meta"))
    summary["flops_per_token"] = flops_per_token(args, include_recompute=args.checkpoint_activations)
    return summary


def _print_table(summary: dict[str, int]) -> None:
    for name, value in summary.items():
        if name == "flops_per_token":
            print(f"{'training FLOPs per token':<26}{value / 1e9:>12.3f} G")
        else:
            print(f"{name:<26}{value:>14,d}  ({value / 1e6:.1f}M)")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="+", help="YAML config files, later ones override earlier ones")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help=f"padded vocabulary size (default: the config's, else {DEFAULT_PADDED_VOCAB_SIZE})")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    options = parser.parse_args(argv)

    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed, imported by config checks, logs to stdout
        cfg = load_config(options.configs)
    vocab_size = options.vocab_size or cfg.padded_vocab_size or DEFAULT_PADDED_VOCAB_SIZE
    summary = summarize(TokenFormerArgs.from_config(cfg, padded_vocab_size=vocab_size))
    if options.json:
        print(json.dumps(summary))
    else:
        _print_table(summary)


if __name__ == "__main__":
    main()
