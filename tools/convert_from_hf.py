"""Convert a TokenFormer Hugging Face model directory back into a checkpoint this framework trains, grows and
evaluates, e.g. after fine-tuning it with `transformers`.

    python tools/convert_from_hf.py exported/demo-hf checkpoints/demo-finetuned --config configs/demo.yml \
        [--model-parallel-size 2]

HF_DIR is a directory tools/convert_to_hf.py wrote, or `save_pretrained` of the model loaded from one
(safetensors, sharded or not). CFG.yml (one or more YAML files, merged left to right) is the run config to
continue with: its architecture keys must be those of HF_DIR/config.json (one error names every difference);
per-layer norm_token_counts (grown models) come from config.json. OUTPUT_DIR (new or empty) gets
global_step0/mp_rank_XX_model_states.pt for each of --model-parallel-size tensor ranks (default: the config's),
config.json and latest, as tools/convert_official_checkpoint.py writes them: iteration 0, no optimizer state, fp32
weights. It loads with load_model, generate.py and eval.py (load=OUTPUT_DIR); tools/grow_checkpoint.py grows or
re-shards it into a checkpoint a run continues from with `load`.
A problem is one line on stderr and exit status 2.
"""

import argparse
from collections.abc import Sequence
from pathlib import Path

from megatron.checkpoint.output_directory import require_new_or_empty
from megatron.config import load_config
from megatron.formats import huggingface
from megatron.formats.deepspeed.files import write_checkpoint
from megatron.formats.registry import check_state_fits
from megatron.formats.tensor_parallel import split_dimensions, split_state
from megatron.model import TokenFormerArgs


def convert_from_hf(hf_dir: Path, output_dir: Path, configs: Sequence[str | Path],
                    model_parallel_size: int | None = None) -> Path:
    """The model in `hf_dir` as a checkpoint in `output_dir` for the run config `configs` (YAML files merged left
    to right); returns its tag directory."""
    require_new_or_empty(output_dir, "OUTPUT_DIR")
    cfg = load_config(configs, [f"model_parallel_size={model_parallel_size}"] if model_parallel_size else [])
    state, cfg = huggingface.read(hf_dir, cfg)
    args = TokenFormerArgs.for_inference(cfg, cfg.padded_vocab_size)
    check_state_fits(state, cfg, hf_dir)
    return write_checkpoint(split_state(state, split_dimensions(args), cfg.model_parallel_size), cfg, output_dir)


def main(argv: Sequence[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hf_dir", type=Path, help="the Hugging Face model directory")
    parser.add_argument("output_dir", type=Path, help="new or empty directory for the checkpoint")
    parser.add_argument("--config", nargs="+", required=True,
                        help="the run config to train the model with: YAML files, merged left to right")
    parser.add_argument("--model-parallel-size", type=int, help="tensor-parallel ranks to split into")
    args = parser.parse_args(argv)
    try:
        tag_dir = convert_from_hf(args.hf_dir, args.output_dir, args.config, args.model_parallel_size)
    except (ValueError, OSError, KeyError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error  # KeyError quotes its text
        parser.exit(2, f"{parser.prog}: error: {message}\n")
    print(f"wrote {tag_dir} ({args.output_dir / 'latest'} names it)")
    return tag_dir


if __name__ == "__main__":
    main()
