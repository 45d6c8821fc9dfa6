"""Running one step's process for the local driver: its output into a log file, stopped cleanly with the driver.

The process writes straight into the log file (the driver echoes the file, it does not relay a pipe), so it
never depends on the driver to write. It runs in a session of its own, with the kernel sending it SIGTERM the
moment the driver dies, however it dies (PR_SET_PDEATHSIG): deepy.py then passes the stop to its ranks, which
save a checkpoint at the next iteration boundary and exit (megatron/launch/supervise.py). A driver killed with
SIGKILL therefore leaves a stage that resumes where it stopped, not ranks training on unattended. SIGINT or
SIGTERM to the driver are passed on the same way, and the driver waits for the step to stop.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StepFailed(RuntimeError):
    """A step's process exited non-zero; the message ends with the tail of its log."""


class Interrupted(RuntimeError):
    """The driver was asked to stop; the step's process has stopped."""

    def __init__(self, number: int) -> None:
        super().__init__(f"stopped by {signal.Signals(number).name}; run the same command again to continue")
        self.number = number


def _terminated_with(parent: int) -> Callable[[], None]:
    """In the child, before exec: SIGTERM when `parent` ends (at once if it already has). Linux only."""

    def set_up() -> None:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)

    return set_up


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])


def run_step(name: str, command: list[str], log_path: Path, echo: bool) -> float:
    """Run `command` to its end, its output appended to `log_path` (and copied to stdout when `echo`); the
    seconds it took. StepFailed on a non-zero exit, Interrupted if the driver was asked to stop."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"\n[{time.strftime('%Y-%m-%d %H:%M:%S')}] {' '.join(command)}\n")
        start_offset = log.tell()
    start = time.perf_counter()
    with open(log_path, "a", encoding="utf-8") as log, open(log_path, encoding="utf-8", errors="replace") as reader:
        reader.seek(start_offset)
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   preexec_fn=_terminated_with(os.getpid()), env=dict(os.environ, PYTHONUNBUFFERED="1"))
        received: list[int] = []

        def forward(number: int, frame: object) -> None:
            received.append(number)
            process.send_signal(signal.SIGTERM)

        previous = {number: signal.signal(number, forward) for number in STOP_SIGNALS}
        try:
            while process.poll() is None:
                time.sleep(0.5)
                if echo:
                    sys.stdout.write(reader.read())
                    sys.stdout.flush()
            if echo:
                sys.stdout.write(reader.read())
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)
    if received:
        raise Interrupted(received[0])
    seconds = time.perf_counter() - start
    if process.returncode != 0:
        raise StepFailed(f"{name} exited {process.returncode} after {seconds:.0f} s; last lines of {log_path}:\n"
                         f"{_tail(log_path)}")
    return seconds
