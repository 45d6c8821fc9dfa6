"""Build the GPT2Dataset and blending indices of a Pile-sized dataset and report seconds and peak memory.

    python -m benchmarks.index_build [--documents 210000000] [--tokens 300e9] [--seq-length 2048]

The dataset is synthetic: only its sizes array exists (210M documents whose
lengths average 300B / 210M tokens), which is all index building reads. Each
builder runs in its own process, so its peak resident memory (ru_maxrss)
is its own: the compiled helpers (helpers.cpp) and the NumPy fallback
(TOKENFORMER_DATA_HELPERS=numpy). The index build is the real GPT2Dataset
path: doc_idx, sample_idx, shuffle_idx, written as .npy caches beside the
prefix. The blend is of 30 datasets (the Pile's shard count) over the same
number of samples. One epoch is built (num_samples = tokens // seq_length);
sample_idx is also timed on its own, as the part the helpers replace.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

from megatron.data.blending_index import build_blending_indices
from megatron.data.compiled_helpers import load_helpers
from megatron.data.gpt2_dataset import GPT2Dataset
from megatron.data.sample_index import build_sample_idx

_CHUNK = 1 << 24


class SyntheticSizes:
    """Stands in for MMapIndexedDataset where index building is concerned: its length and sizes."""

    def __init__(self, documents: int, tokens: float, seed: int = 0):
        rng = np.random.default_rng(seed)
        mean = tokens / documents
        self.sizes = np.empty(documents, dtype=np.int32)
        for start in range(0, documents, _CHUNK):
            count = min(_CHUNK, documents - start)
            self.sizes[start : start + count] = np.minimum(rng.exponential(mean, count) + 1, 2**31 - 1).astype(np.int32)

    def __len__(self) -> int:
        return len(self.sizes)


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_one(args: argparse.Namespace) -> dict:
    """Runs in a child process: one builder, its timings and its peak memory."""
    start = time.time()
    data = SyntheticSizes(args.documents, args.tokens)
    tokens = int(np.sum(data.sizes, dtype=np.int64))
    num_samples = (tokens - 1) // args.seq_length
    result = {"documents": len(data), "tokens": tokens, "samples": num_samples, "sizes_s": time.time() - start}
    result["compiled"] = load_helpers() is not None
    with tempfile.TemporaryDirectory(dir=args.workdir) as directory:
        start = time.time()
        documents = np.arange(len(data), dtype=np.int64)
        prefix = os.path.join(directory, "pile")
        dataset = GPT2Dataset("train", prefix, documents, data, num_samples, args.seq_length, 1234)
        result["index_s"] = time.time() - start
        result["index_samples"] = len(dataset)
        start = time.time()
        build_sample_idx(data.sizes, np.asarray(dataset.doc_idx), args.seq_length, 1, tokens)
        result["sample_idx_s"] = time.time() - start
        del dataset, documents
        start = time.time()
        weights = np.random.default_rng(1).random(30) + 0.5
        build_blending_indices(weights / weights.sum(), num_samples)
        result["blend_s"] = time.time() - start
    result["peak_gb"] = peak_gb()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=210_000_000)
    parser.add_argument("--tokens", type=float, default=300e9)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--workdir", default=None, help="where the .npy caches go (about 4 GB)")
    parser.add_argument("--builders", nargs="+", default=["compiled", "numpy"], choices=["compiled", "numpy"])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_one(args)))
        return
    for builder in args.builders:
        env = dict(os.environ, TOKENFORMER_DATA_HELPERS="numpy" if builder == "numpy" else "")
        command = [sys.executable, __file__, "--child", "--documents", str(args.documents)]
        command += ["--tokens", str(args.tokens), "--seq-length", str(args.seq_length)] + (["--workdir", args.workdir] if args.workdir else [])
        output = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
        r = json.loads(output.strip().splitlines()[-1])
        assert r["compiled"] == (builder == "compiled"), f"{builder} builder requested but compiled={r['compiled']}"
        print(
            f"{builder:8s} {r['documents']:,} documents, {r['tokens']:,} tokens -> {r['index_samples']:,} samples of "
            f"{args.seq_length}: GPT2Dataset index {r['index_s']:.1f} s (of which sample_idx alone "
            f"{r['sample_idx_s']:.1f} s), 30-way blend {r['blend_s']:.1f} s, "
            f"peak memory {r['peak_gb']:.2f} GB (synthetic sizes {r['sizes_s']:.1f} s)"
        )


if __name__ == "__main__":
    main()
