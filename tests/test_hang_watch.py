"""A hang while steps run ends the job within hang_timeout + 60 s, naming the rank that did not arrive, with every
live rank's stack written (a real deepy.py launch of the tiny config on 2 processes, one rank SIGSTOPped
mid-run); the first step and paused work (evaluation, saves) do not trip the watch (one forked gloo rank)."""

from __future__ import annotations

import contextlib
import signal
import socket
import time
from pathlib import Path

import psutil
import pytest

from megatron.config.run_inputs import HUNG
from megatron.launch.supervise import runs_script
from megatron.runtime.hang_watch import HangWatch
from tests.distributed import run_on_ranks
from tests.test_launch_signals import start_training, wait_for_iteration

pytestmark = pytest.mark.slow

HANG_TIMEOUT = 5


def _rank_process(launcher_pid: int, local_rank: int) -> psutil.Process:
    for process in psutil.Process(launcher_pid).children(recursive=True):
        command = process.cmdline()
        if runs_script(command, "train.py") and f"--local_rank={local_rank}" in command:
            return process
    raise AssertionError(f"no rank {local_rank} under deepy.py")


def test_a_stopped_rank_ends_the_job_named_within_hang_timeout(demo_data, tmp_path):
    run = tmp_path / "run"
    launcher = start_training(demo_data, run, f"hang_timeout={HANG_TIMEOUT}", "save=null", "load=null")
    wait_for_iteration(launcher, run, 3)
    descendants = psutil.Process(launcher.pid).children(recursive=True)
    stopped = _rank_process(launcher.pid, 1)
    try:
        stopped.send_signal(signal.SIGSTOP)
        start = time.monotonic()
        stdout, stderr = launcher.communicate(timeout=HANG_TIMEOUT + 60)
        seconds = time.monotonic() - start
    finally:  # nothing is left when the watch works
        for process in [stopped, *descendants]:
            with contextlib.suppress(psutil.Error):
                process.kill()
        launcher.kill()
    assert launcher.returncode == HUNG, stdout + stderr
    assert seconds < HANG_TIMEOUT + 60
    line = next(line for line in stderr.splitlines() if line.startswith("hang: "))
    host = socket.gethostname()
    assert f"Did not arrive: rank 1 on {host} (its heartbeat stopped" in line, line
    assert "rank 0 on" not in line.split("Did not arrive:")[1].split(". Rank 0")[0], line
    assert f"Rank 0 on {host} waited in " in line, line
    assert "deepy.py: train.py hung (exit status 124)" in stderr, stderr
    stacks = (run / "logs" / "hangs" / "rank0.stacks.txt").read_text()
    assert "Thread" in stacks and "pretrain.py" in stacks, stacks


def _watch_through_pauses(log_dir: Path) -> str:
    watch = HangWatch(1.0, log_dir)
    time.sleep(3)  # the first step (compilation): not armed yet
    watch.step_done(1)
    with watch.paused():
        time.sleep(3)  # an evaluation or a save
    watch.step_done(2)
    watch.stop()
    return "not ended"


def test_the_first_step_and_paused_work_do_not_trip_the_watch(tmp_path):
    assert run_on_ranks(1, _watch_through_pauses, tmp_path, timeout=30) == ["not ended"]
    assert not (tmp_path / "hangs").exists()
