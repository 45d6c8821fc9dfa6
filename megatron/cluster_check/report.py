"""What a section of the cluster check found, and the two ways it is shown: the markdown report
(log_dir/cluster_check.md) and the one-screen console summary.

A section ends PASS, FAIL or SKIP. Every FAIL carries at least one `Finding`: where (a rank and its host, a
host, a group of ranks), what was seen, and the likely fix, so that the person reading the report on a new
cluster knows which node to look at. `facts` are what later sections' premises read (megatron/cluster_check/
sections.py): a section is skipped when one it depends on found its premise false. Until the check ends the
report's header says INCOMPLETE (`incomplete`), with the signal that stopped it if one did: a verdict covers
every selected section or is not given.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from pathlib import Path

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
CONSOLE_FINDINGS = 8  # findings printed on the console; the report has them all


@dataclass
class Finding:
    where: str  # "rank 3 on node-b", "host node-b", "all-reduce over the world (node-a, node-b)"
    what: str
    fix: str


@dataclass
class SectionResult:
    name: str
    status: str = PASS
    summary: str = ""  # one line
    figures: list[str] = field(default_factory=list)  # markdown lines: tables, bullet points
    findings: list[Finding] = field(default_factory=list)
    facts: dict[str, bool] = field(default_factory=dict)
    seconds: float = 0.0

    def fail(self, where: str, what: str, fix: str) -> None:
        self.status = FAIL
        self.findings.append(Finding(where, what, fix))


@dataclass
class RunDescription:
    """The run the report is about, for its header."""

    config_files: list[str]
    world_size: int
    hosts: list[str]
    layout: str  # "tensor 2 x pipeline 2 x data 1"
    device: str


def overall(results: list[SectionResult]) -> str:
    return FAIL if any(r.status == FAIL for r in results) else PASS


def incomplete(done: int, selected: int, stopped_by: str | None = None, during: str | None = None) -> str:
    """The header of a check that has not ended: a verdict needs every selected section."""
    if stopped_by is None:
        return (f"INCOMPLETE ({done} of {selected} sections done; the check has not ended, or was killed: the "
                "verdict is written when it ends)")
    where = f" during {during}" if during else ""
    return f"INCOMPLETE (stopped by {stopped_by}{where}: {done} of {selected} sections done)"


def markdown(results: list[SectionResult], run: RunDescription, seconds: float, status: str | None = None) -> str:
    """The report: a header with `status` (by default the verdict, overall's), a table of the sections, then each
    section's figures and findings."""
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    hosts = ", ".join(run.hosts)
    lines = [f"# Cluster check: {status or overall(results)}", "",
             f"- date: {date}; {seconds:.0f} s",
             f"- configs: {' '.join(run.config_files) or '(none recorded)'}",
             f"- {run.world_size} processes on {len(run.hosts)} host{'s' * (len(run.hosts) != 1)} ({hosts}); "
             f"layout {run.layout}; device {run.device}", "",
             "| section | status | seconds | summary |", "|---|---|---|---|"]
    lines += [f"| {r.name} | {r.status} | {r.seconds:.1f} | {r.summary.replace('|', '/')} |" for r in results]
    for r in results:
        lines += ["", f"## {r.name}: {r.status}", "", r.summary]
        if r.figures:
            lines += ["", *r.figures]
        if r.findings:
            lines += ["", "Failures:", ""]
            lines += [f"- **{f.where}**: {f.what}. *Likely fix:* {f.fix}" for f in r.findings]
    return "\n".join(lines) + "\n"


def console_summary(results: list[SectionResult], report: Path | None, seconds: float) -> str:
    """One screen: each section's status and summary, the first findings, where the report is."""
    lines = ["", f"cluster check: {overall(results)} ({seconds:.0f} s)"]
    lines += [f"  {r.status:<4}  {r.name:<12} {r.summary}" for r in results]
    findings = [(r.name, f) for r in results for f in r.findings]
    for name, f in findings[:CONSOLE_FINDINGS]:
        lines.append(f"  FAIL {name}: {f.where}: {f.what}; fix: {f.fix}")
    if len(findings) > CONSOLE_FINDINGS:
        lines.append(f"  ... and {len(findings) - CONSOLE_FINDINGS} more failures in the report")
    if report is not None:
        lines.append(f"  report: {report}")
    return "\n".join(lines)
