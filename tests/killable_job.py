"""A job of forked gloo ranks that a test can signal or SIGKILL the way a scheduler would.

    job = start_job(2, function, *args, log=tmp_path / "job.log")
    wait_until(lambda: ..., job)           # e.g. until metrics.jsonl reaches some iteration
    job.kill()                             # SIGKILL to the leader and every rank at once

The leader is forked from the test process (torch and DeepSpeed already imported,
so a launch costs the engine's start-up, not the imports) into a session of its
own and runs tests.distributed.run_on_ranks there: the ranks are its children in
its process group, and one killpg ends them all mid-step or mid-save. The
leader exits 0 when every rank returned, 1 otherwise; the output of all of them
goes to `log`.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.distributed import run_on_ranks

JOB_TIMEOUT_SECONDS = 240


def _leader(world_size: int, function: Callable, args: tuple, log: Path) -> None:
    os.setsid()
    descriptor = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    try:
        run_on_ranks(world_size, function, *args, timeout=JOB_TIMEOUT_SECONDS)
    except BaseException:  # noqa: BLE001 - the exit code and the log tell the test
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


@dataclass
class Job:
    process: multiprocessing.Process
    log: Path

    def alive(self) -> bool:
        return self.process.is_alive()

    def kill(self) -> None:
        """SIGKILL to the leader and every rank, then reap the leader and wait until every rank has exited: a
        rank killed inside a write exits when the write returns, and holds its files and the save directory's
        lock until then (a next start would find the directory in use)."""
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.join()
        deadline = time.monotonic() + JOB_TIMEOUT_SECONDS
        while _group_running(self.process.pid):
            if time.monotonic() > deadline:
                raise AssertionError(f"process group {self.process.pid} still running {JOB_TIMEOUT_SECONDS} s "
                                     "after SIGKILL")
            time.sleep(0.005)

    def wait(self, timeout: float = JOB_TIMEOUT_SECONDS) -> int:
        """The leader's exit code; kills the job and fails if it does not end within `timeout`."""
        self.process.join(timeout)
        if self.process.is_alive():
            self.kill()
            raise AssertionError(f"the job did not end within {timeout} s:\n{self.log.read_text()}")
        return self.process.exitcode


def _group_running(group: int) -> bool:
    """Whether a process of process group `group` has not exited (a zombie has: it holds no file or lock)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _, process_group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):  # the process ended while it was read
            continue
        if state != "Z" and int(process_group) == group:
            return True
    return False


def start_job(world_size: int, function: Callable, *args: Any, log: Path) -> Job:
    process = multiprocessing.get_context("fork").Process(target=_leader, args=(world_size, function, args, log))
    process.start()
    while os.getpgid(process.pid) != process.pid:  # until the leader has its own group, which kill() signals
        time.sleep(0.001)
    return Job(process, log)


def wait_until(condition: Callable[[], bool], job: Job, timeout: float = JOB_TIMEOUT_SECONDS,
               poll_seconds: float = 0.002) -> None:
    """Poll `condition` until it holds; fails if the job ends first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while not condition():
        if not job.alive():
            raise AssertionError(f"the job ended (exit code {job.process.exitcode}) before the condition held:\n"
                                 f"{job.log.read_text()}")
        if time.monotonic() > deadline:
            job.kill()
            raise AssertionError(f"condition not reached within {timeout} s:\n{job.log.read_text()}")
        time.sleep(poll_seconds)
