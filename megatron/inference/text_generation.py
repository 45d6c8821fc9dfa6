"""generate.py's modes (GPT-NeoX's text_gen_type) and its jsonl output.

    unconditional   num_samples samples, each starting from the end-of-document token
    input-file      one sample per prompt of sample_input_file (prompts separated by prompt_end)
    interactive     one sample per line typed on standard input, until end of input

Sample i draws from a generator seeded with seed + i, so samples do not depend on the number of
processes or on the KV cache. Global rank 0 appends one JSON object per sample to sample_output_file:
{"context", "text", "length" (tokens generated), "finished" (ended by itself), "duration_seconds"}.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import TextIO

import torch

from megatron.config import Config
from megatron.inference.distributed import from_output_rank, is_output_rank
from megatron.inference.generation import generate
from megatron.inference.sampling import SamplingParams
from megatron.model import TokenFormerModel
from megatron.tokenizer import AbstractTokenizer


def _file_prompts(cfg: Config) -> list[str]:
    text = Path(cfg.sample_input_file).read_text(encoding="utf-8")
    return [prompt.strip() for prompt in text.split(cfg.prompt_end) if prompt.strip()]


def _typed_prompts(stdin: TextIO) -> Iterator[str]:
    """Lines read on the output rank and handed to every rank; blank lines are skipped."""
    while True:
        line = None
        if is_output_rank():
            print("prompt> ", end="", flush=True)
            line = stdin.readline()
        line = from_output_rank(line)
        if not line:
            return
        if line.strip():
            yield line.rstrip("\n")


def prompts_of(cfg: Config, stdin: TextIO | None = None) -> Iterator[str]:
    """The prompts of `cfg.text_gen_type`; "" stands for no prompt (unconditional)."""
    if cfg.text_gen_type == "unconditional":
        return iter([""] * cfg.num_samples)
    if cfg.text_gen_type == "input-file":
        return iter(_file_prompts(cfg))
    return _typed_prompts(stdin or sys.stdin)


def generate_samples(cfg: Config, model: TokenFormerModel, tokenizer: AbstractTokenizer, device: torch.device,
                     stdin: TextIO | None = None) -> list[dict]:
    """Generate for every prompt of the configured mode; returns the records written to sample_output_file."""
    sampling = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p)
    records = []
    with open(cfg.sample_output_file, "w", encoding="utf-8") if is_output_rank() else nullcontext() as output:
        for index, prompt in enumerate(prompts_of(cfg, stdin)):
            tokens = tokenizer.tokenize(prompt) if prompt else [tokenizer.eod]
            generator = torch.Generator(device).manual_seed(cfg.seed + index)
            start = time.perf_counter()
            [result] = generate(model, torch.tensor([tokens], device=device), cfg.maximum_tokens, sampling,
                                eod=tokenizer.eod, vocab_size=tokenizer.vocab_size, use_cache=not cfg.recompute,
                                generator=generator)
            record = {"context": prompt, "text": tokenizer.detokenize(result.tokens), "length": len(result.tokens),
                      "finished": result.finished, "duration_seconds": time.perf_counter() - start}
            records.append(record)
            if output is not None:
                output.write(json.dumps(record) + "\n")
                output.flush()
                if cfg.text_gen_type == "interactive":
                    print(prompt + record["text"], flush=True)
    return records
