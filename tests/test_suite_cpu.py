"""benchmarks/suite_cpu.py: the plugin records each test's CPU-seconds, its child processes' included, and the
report ranks them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmarks import suite_cpu
from tests.conftest import REPO

TESTS = '''
import subprocess, sys

def test_busy_child():
    spin = "import time\\nwhile time.process_time() < 0.5: pass"
    subprocess.run([sys.executable, "-c", spin], check=True)

def test_idle():
    pass
'''


def test_a_test_is_charged_its_childrens_cpu_and_the_report_ranks_it_first(tmp_path):
    (tmp_path / "test_sample.py").write_text(TESTS)
    out = tmp_path / "cpu.jsonl"
    environment = {**os.environ, suite_cpu.OUT_VARIABLE: str(out), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "benchmarks.suite_cpu", "-p", "no:cacheprovider",
                           "-q", str(tmp_path / "test_sample.py")], cwd=tmp_path, env=environment,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    records = {r["test"].split("::")[1]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(records) == {"test_busy_child", "test_idle"}
    assert records["test_busy_child"]["cpu"] >= 0.5 > records["test_idle"]["cpu"]  # the child spun 0.5 CPU-seconds
    lines = suite_cpu.report(list(records.values()), top=5)
    assert lines[0].startswith("2 tests, ")
    assert lines[lines.index("| test | CPU-s | wall s |") + 2].startswith("| test_sample.py::test_busy_child |")
    assert lines[-1] == "share of the CPU-seconds in tests over 15 s: 0.000"
    worker = records["test_idle"]["worker"]  # "main", or the xdist worker's name inherited from make test's worker
    assert records["test_busy_child"]["worker"] == worker
    worker_row = next(line for line in lines if line.startswith(f"| {worker} |"))
    assert worker_row.startswith(f"| {worker} | 2 |") and float(worker_row.split("|")[4]) >= 0.5


def test_a_missing_record_file_is_one_line_naming_it(tmp_path):
    done = subprocess.run([sys.executable, "-m", "benchmarks.suite_cpu", str(tmp_path / "none.jsonl")], cwd=REPO,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "none.jsonl" in done.stderr and "PYTEST_ADDOPTS='-p benchmarks.suite_cpu'" in done.stderr
