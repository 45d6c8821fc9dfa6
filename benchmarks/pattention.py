"""Pattention forward+backward time vs its six GEMMs alone, and activation memory vs the plain formula.

    .venv/bin/python benchmarks/pattention.py [--tokens 1024] [--repeats 5]

Shapes are the paper configs' Pattention layers (width d, n parameter tokens) for
`--tokens` input tokens (a micro-batch slice that fits this CPU). The GEMM-only
baseline runs exactly the six matrix products a Pattention needs (forward X·Kᵀ
and S·V; backward dY·Vᵀ, Sᵀ·dY, dA·K and dAᵀ·X) with no normalisation: the
limit any implementation can reach. Memory is the bytes autograd keeps for
backward, parameters and input excluded. The last line is the worst (largest)
time ratio of the fused implementation over all shapes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.model.pattention import fused_pattention, pattention  # noqa: E402

SHAPES = [  # (name, d, n)
    ("150M qkv/proj", 768, 768),
    ("150M ffn", 768, 3072),
    ("450M ffn", 1024, 4096),
    ("1-5B qkv/proj", 1536, 1536),
]


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def tensors(tokens: int, d: int, n: int):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, d, generator=g).requires_grad_()
    key = (torch.randn(n, d, generator=g) * 0.02).requires_grad_()
    value = (torch.randn(n, d, generator=g) * 0.02).requires_grad_()
    return x, key, value


def gemms_only(x, key, value, grad_out):
    with torch.no_grad():
        scores = x @ key.t()
        out = scores @ value
        grad_scores = grad_out @ value.t()
        _ = scores.t() @ grad_out
        _ = grad_scores @ key
        _ = grad_scores.t() @ x
    return out


def run_layer(fn, x, key, value, grad_out):
    for t in (x, key, value):
        t.grad = None
    fn(x, key, value, "l2_norm_gelu", 1.0, key.shape[0]).backward(grad_out)


def saved_bytes(fn, x, key, value) -> int:
    kept = {x.data_ptr(), key.data_ptr(), value.data_ptr()}
    total = 0

    def pack(t):
        nonlocal total
        if t.data_ptr() not in kept:
            kept.add(t.data_ptr())
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x, key, value, "l2_norm_gelu", 1.0, key.shape[0]).sum().backward()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"threads={torch.get_num_threads()} tokens={args.tokens} Θ=l2_norm_gelu fp32; times are medians (ms)")
    header = f"{'layer':<15} {'d':>5} {'n':>5} {'GEMMs':>8} {'plain':>8} {'fused':>8} {'plain/G':>8} {'fused/G':>8} {'mem fused/plain':>16}"
    print(header)
    print("-" * len(header))
    worst = 0.0
    for name, d, n in SHAPES:
        x, key, value = tensors(args.tokens, d, n)
        grad_out = torch.randn(args.tokens, d)
        gemm = median_seconds(lambda: gemms_only(x, key, value, grad_out), args.repeats)
        plain = median_seconds(lambda: run_layer(pattention, x, key, value, grad_out), args.repeats)
        fused = median_seconds(lambda: run_layer(fused_pattention, x, key, value, grad_out), args.repeats)
        memory = saved_bytes(fused_pattention, x, key, value) / saved_bytes(pattention, x, key, value)
        worst = max(worst, fused / gemm)
        print(f"{name:<15} {d:>5} {n:>5} {gemm * 1e3:>8.1f} {plain * 1e3:>8.1f} {fused * 1e3:>8.1f} "
              f"{plain / gemm:>8.2f} {fused / gemm:>8.2f} {memory:>16.2f}")
    print(f"ratio: fused Pattention time / six GEMMs (worst shape) = {worst:.2f}")


if __name__ == "__main__":
    main()
