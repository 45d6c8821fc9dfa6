#!/usr/bin/env python
"""Generate text with a trained TokenFormer; started by deepy.py on every rank:

    python deepy.py generate.py configs/demo.yml configs/text_generation.yml [key=value ...]

Loads the checkpoint in `load` (any layout it was saved with; a damaged one, by its manifest, stops the
run with one message naming the files), splits it over model_parallel_size processes (num_gpus must equal
model_parallel_size), and writes sample_output_file (jsonl). Modes, sampling keys and the output format:
docs/inference.md.
"""

from __future__ import annotations

from megatron.host.startup import collector_paused

with collector_paused():  # torch and DeepSpeed: 400,000 objects (megatron/host/startup.py)
    from megatron.config import Config
    from megatron.formats.registry import describe_weights
    from megatron.inference import load_model
    from megatron.inference.text_generation import generate_samples
    from megatron.runtime.collectives import is_output_rank
    from megatron.runtime.entry import run_rank
    from megatron.runtime.process_group import initialize_distributed
    from megatron.tokenizer import build_tokenizer


def main(cfg: Config) -> list[dict]:
    device = initialize_distributed(cfg).device
    tokenizer = build_tokenizer(cfg.tokenizer_type, cfg.vocab_file, cfg.merge_file)
    weights = cfg.eval_ckpt or cfg.load
    model = load_model(weights, cfg, device)
    if is_output_rank():
        print(f"loaded {describe_weights(weights)}; generating {cfg.text_gen_type} samples into "
              f"{cfg.sample_output_file}", flush=True)
    return generate_samples(cfg, model, tokenizer, device)


if __name__ == "__main__":
    run_rank(main, __doc__)
