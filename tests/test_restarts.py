"""max_restarts (megatron/launch/restarts.py) on real deepy.py launches of the tiny config on 2 processes: a run whose
ranks are SIGKILLed twice restarts twice and ends as the run without faults did, every loss and the final weights
bitwise; a fault beyond max_restarts ends the job with a line that says so. The same under SLURM:
tests/test_slurm.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest

from tests.conftest import REPO, read_metrics
from tests.distributed import free_port
from tests.launch_checks import run_rank_check
from tests.restart_faults import (FAULTS, ONE_THREAD, assert_equals_the_uninterrupted_run, run_overrides,
                                  send_faults, training_ranks)
from tests.test_launch_signals import TINY
from tests.test_supervise import RANK, supervise, wait_until_ready

pytestmark = pytest.mark.slow


def test_a_run_killed_then_hung_restarts_twice_and_equals_the_uninterrupted_run(demo_data, restart_reference, tmp_path):
    command = [sys.executable, "deepy.py", "train.py", TINY, *run_overrides(demo_data, tmp_path), "max_restarts=2",
               f"master_port={free_port()}"]
    job = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=dict(os.environ, **ONE_THREAD))
    try:
        send_faults(lambda: job.poll() is None, tmp_path, lambda: training_ranks(psutil.Process(job.pid)))
        output, _ = job.communicate(timeout=300)
    finally:
        job.kill()
    assert job.returncode == 0, output
    causes = ("local rank 0 was the first to end: killed by SIGKILL",
              "local rank 0 was the first to end: exited with status 124 (a hang: the 'hang:' line names the ranks "
              "that did not arrive)")
    for restart, ((_, _, _, checkpoint), cause) in enumerate(zip(FAULTS, causes, strict=True), start=1):
        assert (f"deepy.py: restart {restart} of 2 (max_restarts): {cause}; every rank ended, and all start again "
                f"from {tmp_path}/checkpoints/{checkpoint} (iteration {checkpoint.removeprefix('global_step')})"
                ) in output, output
    assert "Did not arrive: rank 1 on" in output, output  # the hang watch named the stopped rank
    assert_equals_the_uninterrupted_run(tmp_path, restart_reference)


# deepy.py's last step with max_restarts: 2 on a config whose save and load are the first argument.
RESTARTING_SUPERVISOR = f"""
import sys
from megatron.config import load_config
from megatron.launch.restarts import run_with_restarts
cfg = load_config([{TINY!r}], ["max_restarts=2", "save=" + sys.argv[1], "load=" + sys.argv[1]], world_size=2)
sys.exit(run_with_restarts(cfg, sys.argv[2:], sys.argv[-1]))
"""


def test_a_stop_that_ends_ranks_still_starting_is_not_restarted(tmp_path):
    """Ranks that catch no signal yet (importing, compiling) end on the stop with a failure's status; a stop you
    asked for is not restarted (two small rank scripts under local_ranks.py, no torch: seconds)."""
    supervisor = supervise(tmp_path, RANK, (RESTARTING_SUPERVISOR, str(tmp_path / "checkpoints")))
    wait_until_ready(supervisor, tmp_path)
    supervisor.send_signal(signal.SIGUSR1)
    _, errors = supervisor.communicate(timeout=60)
    assert supervisor.returncode == 128 + signal.SIGUSR1, errors
    assert "restart" not in errors and errors.splitlines()[-1].endswith(
        "stopped at your request (SIGUSR1) while its ranks were starting, before they could save a checkpoint"), errors


def test_a_fault_beyond_max_restarts_ends_the_job_saying_so(demo_data, tmp_path, monkeypatch):
    """Every launch's rank 1 is SIGKILLed: with max_restarts: 1, the second fault ends the job (the issue's third
    fault with max_restarts: 2, one launch fewer)."""
    monkeypatch.setenv("KILL_RANK", "1")
    result = run_rank_check(demo_data, "max_restarts=1", f"save={tmp_path}/checkpoints",
                            f"load={tmp_path}/checkpoints", f"log_dir={tmp_path}/logs", check=False)
    assert result.returncode == 128 + 9, result.stderr
    errors = result.stderr.splitlines()
    assert errors[-1] == ("deepy.py: tests/scripts/rank_check.py failed again with no restart left (max_restarts = 1): "
                          "the job ends (exit status 137). Fix the cause above and run the same command: it resumes "
                          "from the latest checkpoint"), result.stderr
    assert [line for line in errors if line.startswith("deepy.py: restart")] == [
        "deepy.py: restart 1 of 1 (max_restarts): local rank 1 was the first to end: killed by SIGKILL; every rank "
        f"ended, and all start again from the start: {tmp_path}/checkpoints holds no checkpoint yet"]
    assert [(r["split"], r["restart"]) for r in read_metrics(tmp_path / "logs")] == [("restart", 1)]
