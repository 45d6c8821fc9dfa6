"""Where the test suite's CPU time goes: a pytest plugin that records each test's CPU-seconds, and its report.

    SUITE_CPU_OUT=/tmp/cpu.jsonl PYTEST_ADDOPTS="-p benchmarks.suite_cpu" make test   # or bash .ci/run
    python -m benchmarks.suite_cpu /tmp/cpu.jsonl [--top 30]

`make test` is bound by its two cores, not by waits, and this machine's speed changes during a day by up to 2×,
so a wall time says little about a change; CPU-seconds per test, compared within one run or alone before and
after, do (benchmarks/RESULTS.md, issue 59). A test's figure is its worker's CPU time over the test plus that of
the child processes reaped meanwhile: its ranks and launches, and also a background process started earlier
that ends then (the image's build, reaped by whichever test its worker runs at that moment). The report prints
the CPU-seconds by file and by test, how they spread over sizes, and a last line with the share of the tests
over 15 CPU-seconds.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

OUT_VARIABLE = "SUITE_CPU_OUT"
BUCKETS = ((0, 1), (1, 5), (5, 15), (15, float("inf")))


def cpu_seconds() -> float:
    """This process's CPU time and that of its reaped children, user and system."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    out = os.environ.get(OUT_VARIABLE)
    cpu, wall = cpu_seconds(), time.monotonic()
    yield
    if out:  # one line per test, appended: under xdist every worker writes to the same file
        record = {"test": item.nodeid, "cpu": round(cpu_seconds() - cpu, 3), "wall": round(time.monotonic() - wall, 3),
                  "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "end": round(time.time(), 3)}
        with open(out, "a") as file:
            file.write(json.dumps(record) + "\n")


def report(records: list[dict], top: int) -> list[str]:
    """The report's lines for `records` (the plugin's, one per test)."""
    total = sum(r["cpu"] for r in records)
    by_file = collections.Counter()
    for record in records:
        by_file[record["test"].split("::")[0]] += record["cpu"]
    lines = [f"{len(records)} tests, {total:,.0f} CPU-seconds", "", "| file | CPU-s |", "|---|---|"]
    lines += [f"| {name} | {cpu:,.1f} |" for name, cpu in by_file.most_common(top)]
    lines += ["", "| test | CPU-s | wall s |", "|---|---|---|"]
    lines += [f"| {r['test']} | {r['cpu']:,.1f} | {r['wall']:,.1f} |"
              for r in sorted(records, key=lambda r: -r["cpu"])[:top]]
    lines += ["", "| CPU-seconds per test | tests | CPU-s |", "|---|---|---|"]
    for low, high in BUCKETS:
        inside = [r["cpu"] for r in records if low <= r["cpu"] < high]
        lines.append(f"| {low}-{high:g} | {len(inside)} | {sum(inside):,.0f} |")
    lines += worker_lines(records)
    heavy = sum(r["cpu"] for r in records if r["cpu"] >= BUCKETS[-1][0])
    lines += ["", f"share of the CPU-seconds in tests over {BUCKETS[-1][0]} s: {heavy / total if total else 0:.3f}"]
    return lines


def worker_lines(records: list[dict]) -> list[str]:
    """When each worker finished its last test, from the first test's start: the gap between them is the time one
    worker waited at the suite's end (records before the worker and end fields give none)."""
    timed = [r for r in records if "end" in r]
    if not timed:
        return []
    start = min(r["end"] - r["wall"] for r in timed)
    by_worker = collections.defaultdict(list)
    for record in timed:
        by_worker[record["worker"]].append(record)
    lines = ["", "| worker | tests | CPU-s | last test ended (s) |", "|---|---|---|---|"]
    lines += [f"| {worker} | {len(ran)} | {sum(r['cpu'] for r in ran):,.0f} | "
              f"{max(r['end'] for r in ran) - start:,.1f} |" for worker, ran in sorted(by_worker.items())]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", type=Path, help=f"the file {OUT_VARIABLE} named")
    parser.add_argument("--top", type=int, default=30, help="files and tests listed (default 30)")
    options = parser.parse_args(argv)
    try:
        records = [json.loads(line) for line in options.records.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as error:
        parser.exit(2, f"{parser.prog}: error: {options.records}: {error}; run the suite with {OUT_VARIABLE}=FILE "
                       "and PYTEST_ADDOPTS='-p benchmarks.suite_cpu' first\n")
    print("\n".join(report(records, options.top)))


if __name__ == "__main__":
    main()
