"""Export a checkpoint (or the official release's weights) as a Hugging Face `transformers` model directory.

    python tools/convert_to_hf.py demo_run/checkpoints exported/demo-hf
    python tools/convert_to_hf.py TokenFormer-150M/pytorch_model.bin exported/tokenformer-150m-hf \
        --config TokenFormer/configs/tokenformer/150M_eval.yml
    python tools/convert_to_hf.py CKPT OUT --max-shard-size 2GB

CHECKPOINT is anything load_model reads: a save directory or global_stepN of any tensor/pipeline layout, an
export, or the release's pytorch_model.bin (with --config). OUTPUT_DIR (new or empty) then holds config.json,
model.safetensors (sharded above --max-shard-size, with model.safetensors.index.json), generation_config.json,
configuration_tokenformer.py and modeling_tokenformer.py (loaded with trust_remote_code=True) and tokenizer.json
with tokenizer_config.json: the run's own (HFTokenizer), or its GPT-2 BPE or SentencePiece files converted to
one that encodes and decodes a check text as the run's tokenizer does (else none, and the output says why):

    model = AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(OUT, trust_remote_code=True)  # it reads config.json too

The directory is written under a temporary name and renamed when complete. A problem (a damaged or missing
input, an existing OUTPUT_DIR) is one line on stderr and exit status 2. Back: tools/convert_from_hf.py.
"""

import argparse
from collections.abc import Sequence
from pathlib import Path

from megatron.checkpoint.output_directory import require_new_or_empty
from megatron.config import Config
from megatron.formats.huggingface import parse_size, write_hf_directory
from megatron.formats.registry import read_state


def with_run_files_found(cfg: Config, checkpoint: Path) -> Config:
    """`cfg` with its tokenizer files found: a run's config names them relative to the directory it started in,
    which is this one or, usually, one above the checkpoint. ValueError naming a file found in neither."""
    found = {}
    for key in ("vocab_file", "merge_file"):
        path = getattr(cfg, key, None)
        if path is None or Path(path).is_absolute() or Path(path).exists():
            continue
        above = [folder / path for folder in [checkpoint.resolve(), *checkpoint.resolve().parents]]
        match = next((candidate for candidate in above if candidate.is_file()), None)
        if match is None:
            raise ValueError(f"the checkpoint's {key} {path!r} is relative to the directory its run started in, and "
                             f"neither {Path.cwd()} nor a directory above {checkpoint} holds it: run this from the "
                             "run's directory")
        found[key] = str(match)
    return Config.from_dict({**cfg.to_dict(), **found}) if found else cfg


def main(argv: Sequence[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="checkpoint directory, exported weights or the release's file")
    parser.add_argument("output_dir", type=Path, help="new or empty directory for the Hugging Face model")
    parser.add_argument("--config", type=Path, help="the model's config (YAML or config.json), when the "
                        "checkpoint has none beside it (the official release)")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="largest model.safetensors file before it is split into shards (default 5GB)")
    args = parser.parse_args(argv)
    try:
        max_shard_bytes = parse_size(args.max_shard_size)
        require_new_or_empty(args.output_dir, "OUTPUT_DIR")  # before reading (and hashing) the checkpoint
        state, cfg = read_state(args.checkpoint, args.config)
        cfg = with_run_files_found(cfg, args.checkpoint)
        lines = write_hf_directory(state, cfg, args.output_dir, max_shard_bytes)
    except (ValueError, OSError, KeyError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error  # KeyError quotes its text
        parser.exit(2, f"{parser.prog}: error: {message}\n")
    print("\n".join(lines))
    return args.output_dir


if __name__ == "__main__":
    main()
