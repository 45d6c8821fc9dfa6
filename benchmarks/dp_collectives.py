"""What a data-parallel step's collectives cost on this machine's backend: DDP's all-reduce of the gradients
against ZeRO-1's all-reduce (or reduce-scatter) plus its all-gather of the updated weights.

    .venv/bin/python -m benchmarks.dp_collectives [--elements 6300000] [--ranks 2] [--repeats 10]

P processes (gloo on a CPU; the collectives as torch.distributed runs them, one thread each) time each
collective on a flat fp32 buffer of N elements, the model's gradients or weights: all_reduce, the
reduce_scatter_tensor that would halve ZeRO's reduction on NCCL, and all_gather_into_tensor. The last line is
ZeRO-1's communication per step over DDP's: with DeepSpeed's all-reduce, (all-reduce + all-gather) / all-reduce.
It bounds what ZeRO-1 can reach against DDP where the backend cannot hide the all-gather behind compute.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from tests.distributed import run_on_ranks


def time_collectives(elements: int, repeats: int) -> dict[str, float]:
    """Milliseconds per call of each collective, the median of `repeats` calls after 3 warm-up calls."""
    torch.set_num_threads(1)
    ranks = dist.get_world_size()
    flat = torch.randn(elements - elements % ranks)
    shard, whole = torch.empty(flat.numel() // ranks), torch.empty(flat.numel())
    calls = {"all_reduce": lambda: dist.all_reduce(flat),
             "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(shard, flat),
             "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(whole, shard)}
    timings = {}
    for name, call in calls.items():
        for _ in range(3):
            call()
        samples = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            call()
            samples.append((time.perf_counter() - start) * 1e3)
        timings[name] = sorted(samples)[len(samples) // 2]
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--elements", type=int, default=6_300_000, help="buffer length (default: %(default)s, "
                        "the 6.3M-parameter model of benchmarks/framework_step.py's issue-57 measurement)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    timings = run_on_ranks(args.ranks, time_collectives, args.elements, args.repeats)[0]
    print(f"{args.ranks} processes on gloo, {args.elements:,} fp32 elements ({args.elements * 4 / 2**20:.1f} MiB), "
          f"median of {args.repeats} calls")
    print(f"{'collective':<24} {'ms':>8}")
    for name, ms in timings.items():
        print(f"{name:<24} {ms:8.1f}")
    ddp = timings["all_reduce"]
    zero = ddp + timings["all_gather_into_tensor"]
    print(f"reduce-scatter / all-reduce = {timings['reduce_scatter_tensor'] / ddp:.2f}")
    print(f"ZeRO-1 (all-reduce + all-gather) / DDP (all-reduce) = {zero / ddp:.2f}")


if __name__ == "__main__":
    main()
