"""The cluster check's run on every rank: the sections in order, each skipped (saying why) when one before found
its premise false, the report written after each (INCOMPLETE until the last, then the verdict), the console
summary at the end, and the exit status; a stop signal ends every rank at once, the report saying so.

Premises: every section but the environment needs each rank to have a device of its own (environment fact
`devices`); numerics and throughput, which train, need collectives that give the right values (collectives fact
`correct`); numerics' checkpoint part needs `save` shared by every rank (environment fact `save_shared`). A
section not run (cluster_check_sections) is no premise: what it would check is assumed.

Each section's result is global rank 0's, broadcast, so every rank takes the same path through the sections and
their collectives. An exception a section raises on some rank is that section's FAIL with the rank named (its
traceback goes to that rank's stderr); the check goes on when every rank came back from the section
(section_end.py). When a rank does not come back within hang_timeout (stopped or dead, or waiting in a
collective for one that raised), the hang watch (megatron/runtime/hang_watch.py) ends the check: the rank that
found it writes the report with that section's FAIL naming the ranks, the sections after it not run, and every
rank exits CLUSTER_CHECK_FAILED.
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
from megatron.cluster_check.ranks import Ranks
from megatron.cluster_check.report import (FAIL, SKIP, RunDescription, SectionResult, console_summary, incomplete,
                                           markdown, overall)
from megatron.cluster_check.section_end import section_outcomes
from megatron.config import Config
from megatron.config.run_inputs import CLUSTER_CHECK_FAILED
from megatron.config.schema import CLUSTER_CHECK_SECTIONS
from megatron.runtime.collectives import from_output_rank, is_output_rank
from megatron.runtime.entry import end_process
from megatron.runtime.hang_watch import HangWatch, start_hang_watch
from megatron.runtime.process_group import initialize_distributed

REPORT_NAME = "cluster_check.md"


def _runners(results: dict[str, SectionResult]) -> dict[str, Callable[[CheckContext], SectionResult]]:
    save_shared = results["environment"].facts.get("save_shared", True) if "environment" in results else True
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


RAISED_FIX = "read that rank's error output (its traceback) and fix what it names"


def _run_section(name: str, index: int, context: CheckContext, results: dict[str, SectionResult],
                 watch: HangWatch | None) -> SectionResult:
    """The section on this rank; an exception becomes a FAIL naming every rank it was raised on."""
    result, error = None, None
    try:
        result = _runners(results)[name](context)
    except Exception as raised:  # noqa: BLE001 (reported as the section's failure, the check goes on)
        error = f"{type(raised).__name__}: {raised}"
        traceback.print_exc(file=sys.stderr)
    errors = section_outcomes(watch, index, error)
    if any(errors):
        result = SectionResult(name, summary="stopped by an error")
        for rank, message in enumerate(errors):
            if message:
                result.fail(context.ranks.who(rank), f"raised {message}", RAISED_FIX)
    return result


def _hang_result(name: str, started: float, context: CheckContext, absent: dict[int, str]) -> SectionResult:
    """Section `name`'s FAIL for the ranks that did not come back from it (the hang watch's `absent`)."""
    result = SectionResult(name, summary=f"ended by hang_timeout ({context.cfg.hang_timeout:g} s): a rank did not "
                                         "come back from the section", seconds=time.perf_counter() - started)
    for rank, why in absent.items():
        fix = (RAISED_FIX if why.startswith("raised ") else
               "it waited for a rank named here; fix that one" if why.startswith("alive") else
               f"find why the process stopped: its host's logs (dmesg), its stack in {context.cfg.log_dir}/hangs")
        result.fail(context.ranks.who(rank), why, fix)
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

    def write(self, status: str | None = None, here: bool = False) -> None:
        """The report with `status` as its header (by default the verdict), by the output rank or, `here`, by this
        one."""
        if here or is_output_rank():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(markdown(list(self.results.values()), self.description,
                                          time.perf_counter() - self.start, status), encoding="utf-8")
        self.verdict_written = status is None

    def end_at_hang(self, hung: SectionResult) -> None:
        """The verdict with `hung` as its section's result and the sections after it not run, written by this
        rank (the one whose watch found the hang, whichever it is); the console summary."""
        self.results[hung.name] = hung
        for name in self.selected:
            self.results.setdefault(name, SectionResult(name, SKIP, f"not run: the check ended in {hung.name}"))
        self.write(here=True)
        print(console_summary(list(self.results.values()), self.path.resolve(), time.perf_counter() - self.start),
              flush=True)

    def stop_on_signals(self, hang_claimed: Callable[[], bool]) -> None:
        """SIGTERM (deepy.py's, on Ctrl-C) or SIGINT ends the check at once, its report marked stopped by it:
        written from the handler and ended with os._exit, since unwinding from wherever the signal landed (a
        collective, an engine's construction) could hang on ranks that already left. A stop after the verdict
        was written, or after a rank claimed a hang (`hang_claimed`: its report is the verdict), leaves it."""

        def stop(number: int, frame: object) -> None:
            name = signal.Signals(number).name
            if not self.verdict_written and not hang_claimed():
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
    running = (selected[0], time.perf_counter())  # the section and its start, for the watch's report
    watch = start_hang_watch(
        cfg.hang_timeout, cfg.log_dir, exit_status=CLUSTER_CHECK_FAILED,
        position_text=lambda index: f"the {selected[min(index, len(selected) - 1)]} section",
        at_hang=lambda line, absent: report.end_at_hang(_hang_result(*running, context, absent)))
    report.stop_on_signals(watch.told if watch is not None else lambda: False)
    report.write(incomplete(0, len(selected)))
    for index, name in enumerate(selected):
        section_start = time.perf_counter()
        running = (name, section_start)
        if watch is not None:
            watch.iteration = index  # where this rank is, in its beats
        reason = premise_failed(name, report.results)
        if reason:
            result = SectionResult(name, SKIP, f"skipped: {reason}")
        else:
            result = _run_section(name, index, context, report.results, watch)
        result.seconds = time.perf_counter() - section_start
        result = report.results[name] = from_output_rank(result)
        if is_output_rank():
            print(f"[cluster_check] {name}: {result.status} ({result.seconds:.1f} s) {result.summary}", flush=True)
        report.write(incomplete(len(report.results), len(selected)))
    dist.barrier()
    if watch is not None:
        watch.stop()
    results = list(report.results.values())
    report.write()  # the verdict, last
    if is_output_rank():
        print(console_summary(results, report.path.resolve(), time.perf_counter() - report.start), flush=True)
    return CLUSTER_CHECK_FAILED if overall(results) == FAIL else 0
