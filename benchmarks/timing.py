"""Timing for the benchmarks on a shared machine: alternate the variants, keep each one's fastest run.

Other load slows a run, never speeds it up, so the fastest of several alternating runs is the least
disturbed estimate of each variant, and their ratio compares like with like. `--clock cpu` measures
this process's CPU time instead of wall time: with one thread it leaves out the time the process waited
for a core, the steadier choice when the cores are shared (with more threads it would count the
threads' spinning at barriers).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def add_arguments(parser: argparse.ArgumentParser, repeats: int = 5) -> None:
    parser.add_argument("--repeats", type=int, default=repeats, help="runs of each variant; the fastest counts")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")


def fastest(steps: dict[str, Callable[[], None]], repeats: int, clock: str = "wall") -> dict[str, float]:
    """Each step's fastest of `repeats` runs in seconds (after one warm-up run each), the steps alternating."""
    now = CLOCKS[clock]
    best = {name: float("inf") for name in steps}
    for step in steps.values():
        step()
    for _ in range(repeats):
        for name, step in steps.items():
            start = now()
            step()
            best[name] = min(best[name], now() - start)
    return best
