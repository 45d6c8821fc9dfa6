"""Import the official TokenFormer release into this project's checkpoint layout, or export one back.

    python tools/convert_official_checkpoint.py --input TokenFormer-150M/pytorch_model.bin \
        --config configs/150M.yml --save checkpoints/tokenformer-150m [--model-parallel-size 2]
    python tools/convert_official_checkpoint.py --export --input checkpoints/tokenformer-150m \
        --save exported/pytorch_model.bin

Import writes SAVE/global_step0/mp_rank_XX_model_states.pt for each of model_parallel_size tensor ranks
(default: the config's), SAVE/global_step0/config.json and SAVE/latest, an inference checkpoint for
load_model, generate.py and eval.py (load=SAVE). The config gives the architecture (the release's own
configs/tokenformer/*_eval.yml load as they are); the vocabulary size comes from the weights. Weights are
stored in fp32, which holds the release's fp16 values exactly.
Export reads any checkpoint or weights load_model reads and writes the official layout in fp32: exporting
an import gives back the imported tensors exactly. Key layout: megatron/formats/official.py.
Files are read with torch.load(weights_only=True). Neither direction overwrites: import needs a new or empty
SAVE directory, export a SAVE file that does not exist yet. A problem (a missing or damaged input, an existing
SAVE) is one line on stderr and exit status 2.
"""

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from megatron.config import load_config
from megatron.formats.consolidated import read_weights
from megatron.formats.deepspeed.files import write_checkpoint
from megatron.formats.official import from_official, official_key, to_official
from megatron.formats.registry import check_state_fits, read_state
from megatron.formats.tensor_parallel import split_dimensions, split_state
from megatron.model import TokenFormerArgs


def import_official(weights: Path, config: Path, save: Path, model_parallel_size: int | None = None) -> Path:
    """The release's `weights` as a checkpoint in `save`, split over model_parallel_size ranks; returns its tag dir."""
    cfg = load_config([config], [f"model_parallel_size={model_parallel_size}"] if model_parallel_size else [])
    official = read_weights(weights)
    embedding_key = official_key("word_embeddings.weight", cfg.num_layers)
    if embedding_key not in official:
        raise ValueError(f"{weights} has no {embedding_key}: it is not the official release's pytorch_model.bin")
    cfg.padded_vocab_size = official[embedding_key].shape[0]
    args = TokenFormerArgs.for_inference(cfg, cfg.padded_vocab_size)
    state = {name: t.float() if t.is_floating_point() else t for name, t in from_official(official, args).items()}
    check_state_fits(state, cfg, weights)
    shards = split_state(state, split_dimensions(args), cfg.model_parallel_size)
    return write_checkpoint(shards, cfg, save)


def export_official(checkpoint: Path, save: Path, config: Path | None = None) -> Path:
    """The model saved at `checkpoint` in the official layout, written to the file `save`."""
    if save.exists():
        raise FileExistsError(f"{save} exists: remove it or give another --save (export does not overwrite)")
    state, cfg = read_state(checkpoint, config)
    if cfg.model_type != "tokenformer":
        raise ValueError(f"{checkpoint} holds a model_type {cfg.model_type} model; the official release's layout "
                         "holds TokenFormers only")
    official = to_official(state, cfg.num_layers, cfg.pattention_tau)
    save.parent.mkdir(parents=True, exist_ok=True)
    partial = save.with_name(save.name + ".partial")
    torch.save(official, partial)
    os.replace(partial, save)  # an interrupted export leaves no file under the final name
    return save


def main(argv: Sequence[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", type=Path, required=True,
                        help="import: the release's pytorch_model.bin; export: a checkpoint or weights")
    parser.add_argument("--save", type=Path, required=True,
                        help="import: the checkpoint directory to write; export: the .bin file to write")
    parser.add_argument("--config", type=Path, help="the model's YAML config (import: required; export: only "
                        "when the input has no config.json)")
    parser.add_argument("--model-parallel-size", type=int, help="tensor-parallel ranks to split into (import)")
    parser.add_argument("--export", action="store_true", help="write the official layout instead of reading it")
    args = parser.parse_args(argv)
    if not args.export and args.config is None:
        parser.error("--config is required to import: the architecture of the released model")
    try:
        if args.export:
            target = export_official(args.input, args.save, args.config)
        else:
            target = import_official(args.input, args.config, args.save, args.model_parallel_size)
    except (ValueError, OSError) as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    print(f"wrote {target}")
    return target


if __name__ == "__main__":
    main()
