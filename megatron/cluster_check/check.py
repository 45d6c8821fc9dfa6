"""The cluster check's run on every rank: the sections in order, each skipped (saying why) when one before found
its premise false, the report written after each (INCOMPLETE until the last, then the verdict), the console
summary at the end, and the exit status; a stop signal ends every rank at once, the report saying so.

Premises: every section but the environment needs each rank to have a device of its own (environment fact
`devices`); numerics and throughput, which train, need collectives that give the right values (collectives fact
`correct`); numerics' checkpoint part needs `save` shared by every rank (environment fact `save_shared`). A
section not run (cluster_check_sections) is no premise: what it would check is assumed.

Each section's result is global rank 0's, broadcast, so every rank takes the same path through the sections and
their collectives. An exception a section raises on some rank is that section's FAIL with the rank named (its
traceback goes to that rank's stderr); the check goes on when every rank came back from the section.
"""

from __future__ import annotations

import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from megatron.cluster_check import collectives, environment, golden, numerics, throughput
from megatron.cluster_check.context import CheckContext
from megatron.cluster_check.ranks import Ranks, gather
from megatron.cluster_check.report import (FAIL, SKIP, RunDescription, SectionResult, console_summary, incomplete,
                                           markdown, overall)
from megatron.config import Config
from megatron.config.run_inputs import CLUSTER_CHECK_FAILED
from megatron.config.schema import CLUSTER_CHECK_SECTIONS
from megatron.runtime.collectives import from_output_rank, is_output_rank
from megatron.runtime.entry import end_process
from megatron.runtime.process_group import initialize_distributed

REPORT_NAME = "cluster_check.md"


def _runners(results: dict[str, SectionResult]) -> dict[str, Callable[[CheckContext], SectionResult]]:
    save_shared = results["environment"].facts["save_shared"] if "environment" in results else True
    return {"environment": environment.run, "collectives": collectives.run,
            "numerics": lambda context: numerics.run(context, save_shared), "golden": golden.run,
            "throughput": throughput.run}


def premise_failed(name: str, results: dict[str, SectionResult]) -> str | None:
    """Why section `name` would be meaningless after `results`; None if it can run."""
    env, coll = results.get("environment"), results.get("collectives")
    if name != "environment" and env is not None and not env.facts.get("devices", True):
        return "the environment section found ranks without a device of their own"
    if name in ("numerics", "throughput") and coll is not None and not coll.facts.get("correct", True):
        return "the collectives section found collectives that give wrong values"
    return None


def _run_section(name: str, context: CheckContext, results: dict[str, SectionResult]) -> SectionResult:
    """The section on this rank; an exception becomes a FAIL naming every rank it was raised on."""
    result, error = None, None
    try:
        result = _runners(results)[name](context)
    except Exception as raised:  # noqa: BLE001 (reported as the section's failure, the check goes on)
        error = f"{type(raised).__name__}: {raised}"
        traceback.print_exc(file=sys.stderr)
    errors = gather(error)
    if any(errors):
        result = SectionResult(name, summary="stopped by an error")
        for rank, message in enumerate(errors):
            if message:
                result.fail(context.ranks.who(rank), f"raised {message}",
                            "read that rank's error output (its traceback) and fix what it names")
    return result


def _description(context: CheckContext) -> RunDescription:
    cfg = context.cfg
    data = cfg.world_size // (cfg.model_parallel_size * max(1, cfg.pipe_parallel_size))
    return RunDescription(config_files=list(cfg.config_files or {}), world_size=cfg.world_size,
                          hosts=context.ranks.hosts(), device=str(context.device.type),
                          layout=f"tensor {cfg.model_parallel_size} x pipeline {cfg.pipe_parallel_size} x data {data}")


def report_path(cfg: Config) -> Path:
    return Path(cfg.log_dir or ".") / REPORT_NAME


class _Report:
    """log_dir/cluster_check.md, written by the output rank after every section: INCOMPLETE until the check
    ends, so that a check killed or stopped midway never reads as a verdict."""

    def __init__(self, cfg: Config, description: RunDescription, selected: list[str]):
        self.path, self.description, self.selected = report_path(cfg), description, selected
        self.results: dict[str, SectionResult] = {}
        self.start = time.perf_counter()
        self.verdict_written = False

    def write(self, status: str | None = None) -> None:
        """The report with `status` as its header (by default the verdict)."""
        if is_output_rank():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(markdown(list(self.results.values()), self.description,
                                          time.perf_counter() - self.start, status), encoding="utf-8")
        self.verdict_written = status is None

    def stop_on_signals(self) -> None:
        """SIGTERM (deepy.py's, on Ctrl-C) or SIGINT ends the check at once, its report marked stopped by it:
        written from the handler and ended with os._exit, since unwinding from wherever the signal landed (a
        collective, an engine's construction) could hang on ranks that already left. A stop after the verdict
        was written leaves it."""

        def stop(number: int, frame: object) -> None:
            name = signal.Signals(number).name
            if not self.verdict_written:
                during = next((section for section in self.selected if section not in self.results), None)
                self.write(incomplete(len(self.results), len(self.selected), name, during))
                if is_output_rank():
                    print(f"[cluster_check] stopped by {name}: {self.path.resolve()} is marked INCOMPLETE",
                          flush=True)
            end_process(128 + number)

        for number in (signal.SIGTERM, signal.SIGINT):
            signal.signal(number, stop)


def run_cluster_check(cfg: Config) -> int:
    """Every rank: the selected sections; returns the exit status (CLUSTER_CHECK_FAILED if a section failed, else
    0)."""
    placement = initialize_distributed(cfg)
    context = CheckContext(cfg, Ranks.gather(), placement.device, tag=(cfg.launch_id or "run")[:12])
    selected = [name for name in CLUSTER_CHECK_SECTIONS if name in cfg.cluster_check_sections]
    report = _Report(cfg, _description(context), selected)
    report.stop_on_signals()
    report.write(incomplete(0, len(selected)))
    for name in selected:
        section_start = time.perf_counter()
        reason = premise_failed(name, report.results)
        if reason:
            result = SectionResult(name, SKIP, f"skipped: {reason}")
        else:
            result = _run_section(name, context, report.results)
        result.seconds = time.perf_counter() - section_start
        result = report.results[name] = from_output_rank(result)
        if is_output_rank():
            print(f"[cluster_check] {name}: {result.status} ({result.seconds:.1f} s) {result.summary}", flush=True)
        report.write(incomplete(len(report.results), len(selected)))
    dist.barrier()
    results = list(report.results.values())
    report.write()  # the verdict, last
    if is_output_rank():
        print(console_summary(results, report.path.resolve(), time.perf_counter() - report.start), flush=True)
    return CLUSTER_CHECK_FAILED if overall(results) == FAIL else 0
