"""Export a checkpoint as one consolidated fp32 weights file plus its config.json.

    python tools/export_checkpoint.py demo_run/checkpoints exported/demo [--safetensors] [--config CFG]

Reads whatever load_model reads (any tensor/pipeline-parallel layout, the newest tag of a save directory,
a global_stepN directory) and writes OUT/pytorch_model.bin (a plain state dict, torch.load(weights_only=True)
reads it) or OUT/model.safetensors, with OUT/config.json (the run's resolved config, padded_vocab_size
set). `load_model(OUT)` loads either. The weights are the model's as saved: for fp16/bf16 runs DeepSpeed's
zero_to_fp32 recovers the fp32 master weights instead (docs/inference.md).
The checkpoint's files are checked against its manifest first, and OUT must be new or empty; a problem (a
damaged or missing input, an existing output) is one line on stderr and exit status 2, as the other tools do.
"""

import argparse
from collections.abc import Sequence
from pathlib import Path

from megatron.checkpoint.output_directory import require_new_or_empty
from megatron.formats.consolidated import write_weights
from megatron.formats.registry import read_state


def main(argv: Sequence[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="checkpoint directory (or exported weights)")
    parser.add_argument("out", type=Path, help="directory to write the weights and config.json into")
    parser.add_argument("--safetensors", action="store_true", help="write model.safetensors, not pytorch_model.bin")
    parser.add_argument("--config", type=Path, help="the run's config, when the checkpoint has no config.json")
    args = parser.parse_args(argv)
    try:
        require_new_or_empty(args.out, "the output directory")  # before reading (and hashing) the checkpoint
        state, cfg = read_state(args.checkpoint, args.config)
        cfg.padded_vocab_size = state["word_embeddings.weight"].shape[0]
        target = write_weights(state, cfg, args.out, safetensors=args.safetensors)
    except (ValueError, OSError) as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    print(f"wrote {target} and {target.parent / 'config.json'}")
    return target


if __name__ == "__main__":
    main()
