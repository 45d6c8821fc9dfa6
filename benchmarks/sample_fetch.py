"""Training-batch fetch rate of the data pipeline vs the rate training consumes tokens.

    .venv/bin/python -m benchmarks.sample_fetch [--tokens 100e6] [--datasets 3] [--seq-length 2048]
        [--micro-batch 8] [--batches 400] [--accelerator-tflops 400]

The data is synthetic: `--datasets` prefixes of random documents (lengths drawn like web text, mean
about 1,300 tokens, uint16 tokens of a 50k vocabulary) totalling `--tokens`, written with the project's
MMapIndexedDatasetBuilder and blended by token count, as a multi-source training run does. The fetch
side is exactly what the Trainer runs on each data-parallel rank: the blended GPT2Dataset read through
megatron/training/data.py's `batch_iterator` (shuffled samples, in-process, no worker processes) into
[micro_batch, seq_length + 1] int64 tensors, from a resumed position halfway through the run.

The consuming side is each released config's tokens per second per accelerator at
`--accelerator-tflops` of achieved training FLOP/s (default 400: about 40 % of an H100's dense bf16
peak), with the training FLOPs per token of megatron/model/flops.py (the formula the training log
uses); the data pipeline must keep ahead of the fastest consumer, the smallest model. The page cache is
warm after the data are written (dropping it needs root), so the figure is a memory-read rate; a
cold read adds the disk's time for seq_length × 2 bytes per sample. Index building (one-time, cached)
is reported separately. The last line is the fetch rate over the fastest consumer's rate.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import yaml

from megatron.data.data_utils import build_datasets_from_paths
from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, index_file_path
from megatron.model import TokenFormerArgs, flops_per_token
from megatron.training.data import batch_iterator

ROOT = Path(__file__).resolve().parents[1]

CONFIGS = ("150M", "450M", "900M", "1-5B")
VOCAB = 50_304
DOCUMENTS_PER_WRITE = 10_000


def write_corpus(prefix: str, tokens: int, seed: int) -> None:
    """Random documents of about `tokens` tokens in total, log-normal lengths (median ~600, mean ~1,300)."""
    rng = np.random.default_rng(seed)
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    written = 0
    while written < tokens:
        lengths = np.clip(rng.lognormal(6.4, 1.25, DOCUMENTS_PER_WRITE), 1, 200_000).astype(np.int64)
        builder.add_documents(rng.integers(0, VOCAB, int(lengths.sum()), dtype=np.uint16), lengths)
        written += int(lengths.sum())
    builder.finalize(index_file_path(prefix))


def consumer_rates(tflops: float, seq_length: int) -> dict[str, float]:
    """Tokens per second one accelerator consumes training each released config at `tflops` TFLOP/s."""
    rates = {}
    for config in CONFIGS:
        values = yaml.safe_load((ROOT / "configs" / f"{config}.yml").read_text())
        args = TokenFormerArgs.from_config(SimpleNamespace(**values), padded_vocab_size=VOCAB, seq_length=seq_length,
                                           max_position_embeddings=seq_length)
        rates[config] = tflops * 1e12 / flops_per_token(args, include_recompute=False)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=float, default=100e6, help="corpus size, all datasets together")
    parser.add_argument("--datasets", type=int, default=3)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--batches", type=int, default=400, help="micro-batches fetched (after 10 warm-up ones)")
    parser.add_argument("--accelerator-tflops", type=float, default=400.0)
    parser.add_argument("--workdir", type=Path, help="where the corpus is written (default: a temporary dir)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        start = time.perf_counter()
        prefixes = [os.path.join(tmp, f"part{i}") for i in range(args.datasets)]
        for i, prefix in enumerate(prefixes):
            write_corpus(prefix, int(args.tokens) // args.datasets, seed=i)
        written = time.perf_counter() - start

        train_samples = int(args.tokens) // args.seq_length
        start = time.perf_counter()
        train, _, _ = build_datasets_from_paths(prefixes, None, None, [train_samples, 0, 0], args.seq_length, 1234)
        indexed = time.perf_counter() - start

        batches = batch_iterator(train, consumed_samples=train_samples // 2 // args.micro_batch * args.micro_batch,
                                 micro_batch_size=args.micro_batch, dp_rank=0, dp_size=1)
        for _ in range(10):
            next(batches)
        start = time.perf_counter()
        for _ in range(args.batches):
            batch = next(batches)
        fetched = time.perf_counter() - start
    assert batch.shape == (args.micro_batch, args.seq_length + 1)

    fetch_tokens = args.batches * args.micro_batch * args.seq_length / fetched
    print(f"corpus: {args.datasets} datasets, {args.tokens / 1e6:.0f}M tokens, written in {written:.1f} s; "
          f"train indices ({train_samples:,} samples, blended) built in {indexed:.1f} s")
    print(f"fetch: {args.batches} micro-batches of {args.micro_batch} × {args.seq_length + 1} tokens in "
          f"{fetched:.2f} s = {args.batches / fetched:,.0f} batches/s, {fetch_tokens / 1e6:.2f}M tokens/s "
          f"(one process, warm page cache)")
    print(f"\nconsumers at {args.accelerator_tflops:.0f} TFLOP/s per accelerator, seq_length {args.seq_length}")
    header = f"{'config':<7} {'tokens/s per accelerator':>25} {'fetch / consume':>16}"
    print(header)
    print("-" * len(header))
    rates = consumer_rates(args.accelerator_tflops, args.seq_length)
    for config, rate in rates.items():
        print(f"{config:<7} {rate:>25,.0f} {fetch_tokens / rate:>16.1f}")
    fastest = max(rates, key=rates.get)
    print(f"ratio: fetch rate / the fastest consumer's rate ({fastest}) = {fetch_tokens / rates[fastest]:.1f}")


if __name__ == "__main__":
    main()
