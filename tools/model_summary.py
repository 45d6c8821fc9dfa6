"""Print a TokenFormer's parameter counts by component and its training FLOPs per token.

    python tools/model_summary.py configs/150M.yml [more.yml ...] [key=value ...] [--vocab-size N] [--json]

For a TokenFormer it also prints the dense Transformer baseline's count (model_type: transformer) at the same
width and depth, and the dense width (heads of the same size) whose count is nearest the TokenFormer's at the
same depth: the baseline config of equal parameter count for the paper's comparison.

Later config files override earlier ones, and `key=value` arguments single keys (as deepy.py's). A problem
(a missing file, a bad key or value) is one line on stderr and exit status 2. The model is built on the meta
device, so even the largest
configs take no memory. Configs normally leave padded_vocab_size unset (the tokenizer sets it when a run
starts): the vocabulary is then the config's tokenizer's, padded as a run pads it; where the tokenizer cannot be
read, GPT-NeoX-20B's 50277 tokens padded to a multiple of 128, said on stderr with the reason.
"""

import argparse
import contextlib
import dataclasses
import json
import sys
from collections.abc import Sequence

from megatron.cli import one_line_errors, positive_int
from megatron.config import Config, load_config
from megatron.growth.plan import padded_vocabulary
from megatron.model import TokenFormerArgs, TokenFormerModel, flops_per_token
from megatron.model.parameter_count import count_parameters_by_component

DEFAULT_PADDED_VOCAB_SIZE = 50304


def summarize(args: TokenFormerArgs) -> dict[str, int]:
    """Parameter counts by component, `total_params`, and training FLOPs per token (with recompute
    exactly when the config checkpoints activations)."""
    summary = count_parameters_by_component(TokenFormerModel(args, device="meta"))
    summary["flops_per_token"] = flops_per_token(args, include_recompute=args.checkpoint_activations)
    return summary


def _total(args: TokenFormerArgs) -> int:
    return count_parameters_by_component(TokenFormerModel(args, device="meta"))["total_params"]


def dense_counterparts(args: TokenFormerArgs) -> dict[str, int]:
    """The dense Transformer's total at this width and depth, and the head count (of this head size) whose dense
    model at this depth comes nearest the TokenFormer's total, with that total."""
    dense = dataclasses.replace(args, model_type="transformer")
    target = _total(args)

    def dense_total(heads: int) -> int:
        return _total(dataclasses.replace(dense, hidden_size=heads * args.head_dim, num_attention_heads=heads))

    heads = min(range(1, 4 * args.num_attention_heads + 1), key=lambda h: abs(dense_total(h) - target))
    return {"dense_same_shape_params": _total(dense), "dense_equal_params_hidden_size": heads * args.head_dim,
            "dense_equal_params_num_attention_heads": heads, "dense_equal_params": dense_total(heads)}


def vocabulary_rows(cfg: Config) -> int:
    """The embedding's row count a run of `cfg` would have; where its tokenizer cannot be read, the default,
    with the size and the reason on stderr (a count of the wrong vocabulary would pass as the model's)."""
    try:
        return padded_vocabulary(cfg)
    except (OSError, ValueError) as error:
        print(f"model_summary.py: {error}: assuming a vocabulary of {DEFAULT_PADDED_VOCAB_SIZE} rows (GPT-NeoX-20B's, "
              "padded); give --vocab-size N or the tokenizer's file for the config's", file=sys.stderr)
        return DEFAULT_PADDED_VOCAB_SIZE


def _print_table(summary: dict[str, int]) -> None:
    for name, value in summary.items():
        if name == "flops_per_token":
            print(f"{'training FLOPs per token':<26}{value / 1e9:>12.3f} G")
        elif name == "dense_same_shape_params":
            print(f"dense Transformer, same width and depth: {value:,d} ({value / 1e6:.1f}M)")
        elif name == "dense_equal_params":
            print(f"dense Transformer of equal parameter count at this depth: hidden_size "
                  f"{summary['dense_equal_params_hidden_size']}, num_attention_heads "
                  f"{summary['dense_equal_params_num_attention_heads']}: {value:,d} ({value / 1e6:.1f}M)")
        elif not name.startswith("dense_equal_params_"):
            print(f"{name:<26}{value:>14,d}  ({value / 1e6:.1f}M)")


@one_line_errors("model_summary.py")
def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="+", help="YAML config files, later ones override earlier ones, and "
                        "key=value overrides")
    parser.add_argument("--vocab-size", type=positive_int, default=None,
                        help="padded vocabulary size (default: the config's tokenizer's, padded as a run pads it, else "
                        f"{DEFAULT_PADDED_VOCAB_SIZE})")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    options = parser.parse_args(argv)
    files = [argument for argument in options.configs if "=" not in argument]
    overrides = [argument for argument in options.configs if "=" in argument]
    if not files:
        parser.error("give at least one config file (key=value arguments override its keys)")

    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed, imported by config checks, logs to stdout
        cfg = load_config(files, overrides)
    vocab_size = options.vocab_size or vocabulary_rows(cfg)
    args = TokenFormerArgs.from_config(cfg, padded_vocab_size=vocab_size)
    summary = summarize(args)
    if args.model_type == "tokenformer":
        summary.update(dense_counterparts(args))
    if options.json:
        print(json.dumps(summary))
    else:
        _print_table(summary)


if __name__ == "__main__":
    main()
