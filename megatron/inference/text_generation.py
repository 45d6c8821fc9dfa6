"""generate.py's modes (GPT-NeoX's text_gen_type) and its jsonl output.

    unconditional   num_samples samples, each starting from the end-of-document token
    input-file      one sample per prompt of sample_input_file (prompts separated by prompt_end)
    interactive     one sample per line typed on standard input, until end of input

Sample i draws from a generator seeded with seed + i, so samples do not depend on the number of
processes or on the KV cache. Each prompt is decoded as UTF-8 by itself: one that is not (a stray Latin-1
byte, a binary paste) is named on standard error (file and line, or interactive input line N) and skipped,
and the next prompt is generated; it takes no sample number, as blank lines take none.
Global rank 0 appends one JSON object per sample to sample_output_file:
{"context", "text", "length" (tokens generated), "finished" (ended by itself), "duration_seconds"}.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TextIO

import torch
from tqdm import tqdm

from megatron.config import Config
from megatron.inference.generation import generate
from megatron.inference.sampling import SamplingParams
from megatron.model import TokenFormerModel
from megatron.runtime.collectives import from_output_rank, is_output_rank
from megatron.tokenizer import AbstractTokenizer


@dataclass(frozen=True)
class GenerationSettings:
    """The keys generate.py's modes read (docs/inference.md): the functions below take these, not the Config."""

    text_gen_type: str
    num_samples: int
    sample_input_file: str | None
    prompt_end: str
    sample_output_file: str
    sampling: SamplingParams
    maximum_tokens: int
    use_cache: bool  # not `recompute`
    seed: int

    @classmethod
    def from_config(cls, cfg: Config) -> GenerationSettings:
        return cls(text_gen_type=cfg.text_gen_type, num_samples=cfg.num_samples,
                   sample_input_file=cfg.sample_input_file, prompt_end=cfg.prompt_end,
                   sample_output_file=cfg.sample_output_file,
                   sampling=SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p),
                   maximum_tokens=cfg.maximum_tokens, use_cache=not cfg.recompute, seed=cfg.seed)


def _first_undecodable(text: str) -> int | None:
    """The index of `text`'s first character that stands for a byte that is not UTF-8 (read with
    errors="surrogateescape", such bytes become lone surrogates, which tokenizers refuse); None if none."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return error.start
    return None


def _skipped(where: str, text: str, bad: int) -> None:
    """Say once (on the output rank) which prompt is skipped and why."""
    if is_output_rank():
        column = bad - text.rfind("\n", 0, bad)
        print(f"error: {where} is not UTF-8 text (an undecodable byte at column {column}); skipped it, "
              "generating the next prompt. Save prompts as UTF-8", file=sys.stderr, flush=True)


def _too_long(index: int, prompt: str, tokens: int, limit: int) -> None:
    """Say (on the output rank) that prompt `index` is skipped: the model has no position left to generate at."""
    if is_output_rank():
        start = prompt[:40] + ("..." if len(prompt) > 40 else "")
        print(f"error: prompt {index + 1} ({start!r}) has {tokens} tokens, which leave no room to generate: "
              f"max_position_embeddings={limit}; skipped it, generating the next prompt. Shorten it",
              file=sys.stderr, flush=True)


def _file_prompts(settings: GenerationSettings) -> Iterator[str]:
    """The prompts of sample_input_file, stripped, empty ones skipped; lines are numbered from 1."""
    with open(settings.sample_input_file, encoding="utf-8", errors="surrogateescape") as stream:
        text = stream.read()
    start = 0
    for prompt in text.split(settings.prompt_end):
        bad = _first_undecodable(prompt)
        if bad is not None:
            line = text.count("\n", 0, start + bad) + 1
            _skipped(f"{settings.sample_input_file} line {line}", text, start + bad)
        elif prompt.strip():
            yield prompt.strip()
        start += len(prompt) + len(settings.prompt_end)


def _read_line(stdin: TextIO) -> str:
    """One line of `stdin`, its bytes read as they are when it has them (a terminal or pipe): a text stream
    would stop at the first undecodable byte, or pass it on to the tokenizer, as its error handler says."""
    raw = stdin.buffer.readline() if hasattr(stdin, "buffer") else stdin.readline()
    return raw.decode("utf-8", errors="surrogateescape") if isinstance(raw, bytes) else raw


def _typed_prompts(stdin: TextIO) -> Iterator[str]:
    """Lines read on the output rank and handed to every rank; blank and undecodable lines are skipped."""
    number = 0
    while True:
        line = None
        if is_output_rank():
            print("prompt> ", end="", flush=True)
            line = _read_line(stdin)
        line = from_output_rank(line)
        if not line:
            return
        number += 1
        bad = _first_undecodable(line)
        if bad is not None:
            _skipped(f"interactive input line {number}", line, bad)
        elif line.strip():
            yield line.rstrip("\r\n")


def prompts_of(settings: GenerationSettings, stdin: TextIO | None = None) -> Iterator[str]:
    """The prompts of `settings.text_gen_type`; "" stands for no prompt (unconditional)."""
    if settings.text_gen_type == "unconditional":
        return iter([""] * settings.num_samples)
    if settings.text_gen_type == "input-file":
        return _file_prompts(settings)
    return _typed_prompts(stdin or sys.stdin)


def _prompt_count(settings: GenerationSettings) -> int | None:
    """How many prompts there are (None: typed, not known ahead)."""
    if settings.text_gen_type == "unconditional":
        return settings.num_samples
    if settings.text_gen_type == "input-file":
        text = open(settings.sample_input_file, encoding="utf-8", errors="surrogateescape").read()
        return sum(1 for prompt in text.split(settings.prompt_end) if prompt.strip())
    return None


def shows_progress() -> bool:
    """Whether a progress bar is read by a person: stderr is a terminal, or deepy.py's is (it passes the ranks'
    output on through a pipe and says so in TOKENFORMER_STDERR_IS_A_TERMINAL)."""
    return sys.stderr.isatty() or os.environ.get("TOKENFORMER_STDERR_IS_A_TERMINAL") == "1"


def generate_samples(cfg: Config, model: TokenFormerModel, tokenizer: AbstractTokenizer, device: torch.device,
                     stdin: TextIO | None = None) -> list[dict]:
    """Generate for every prompt of the configured mode; returns the records written to sample_output_file."""
    settings = GenerationSettings.from_config(cfg)
    records = []
    total = _prompt_count(settings)
    progress = tqdm(total=total, unit="sample", desc="generating", file=sys.stderr,
                    disable=total is None or not is_output_rank() or not shows_progress())
    output_file = settings.sample_output_file
    with open(output_file, "w", encoding="utf-8") if is_output_rank() else nullcontext() as output, progress:
        for index, prompt in enumerate(prompts_of(settings, stdin)):
            tokens = tokenizer.tokenize(prompt) if prompt else [tokenizer.eod]
            if len(tokens) >= model.args.max_position_embeddings:
                _too_long(index, prompt, len(tokens), model.args.max_position_embeddings)
                continue
            generator = torch.Generator(device).manual_seed(settings.seed + index)
            start = time.perf_counter()
            [result] = generate(model, torch.tensor([tokens], device=device), settings.maximum_tokens,
                                settings.sampling, eod=tokenizer.eod, vocab_size=tokenizer.vocab_size,
                                use_cache=settings.use_cache, generator=generator)
            record = {"context": prompt, "text": tokenizer.detokenize(result.tokens), "length": len(result.tokens),
                      "finished": result.finished, "duration_seconds": time.perf_counter() - start}
            records.append(record)
            if output is not None:
                output.write(json.dumps(record) + "\n")
                output.flush()
                if settings.text_gen_type == "interactive":
                    print(prompt + record["text"], flush=True)
            progress.update()
    if is_output_rank():
        print(f"wrote {len(records)} samples to {settings.sample_output_file}", flush=True)
    return records
