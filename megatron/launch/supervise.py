"""deepy.py's part once the ranks run: pass a stop signal on to them, wait, and end on a line a person reads.

SIGTERM (a scheduler's stop, `kill`) or SIGINT (Ctrl-C) to deepy.py would end deepy.py alone, leaving the
ranks to train on unattached (DeepSpeed's runner does not forward it on one machine, and its per-node
launcher kills ranks after 30 s). So the launcher runs in a session of its own, and a signal to deepy.py is
sent on as SIGTERM to every rank on this machine, which saves a checkpoint at the next iteration boundary
and exits 0 (training/preemption.py); deepy.py then waits for the launcher to finish and exits with it.
Ranks on other hosts get it from the launcher (SIGTERM to srun or mpirun is forwarded to their tasks). A
SIGTERM to DeepSpeed's runner itself ends the runner only; deepy.py, the subreaper of its descendants, then
finds the ranks orphaned, passes the stop on to them and exits with them.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
from pathlib import Path

import psutil

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def runs_script(command_line: list[str], script: str) -> bool:
    """Whether `command_line` (python [options] SCRIPT args) runs `script`; the runners between deepy.py and
    the ranks run modules (`python -m deepspeed.launcher.launch ... train.py ...`) and do not."""
    for argument in command_line[1:]:
        if argument == "-m":
            return False
        if not argument.startswith("-"):
            return Path(argument).name == Path(script).name
    return False


def _local_ranks(launcher: psutil.Process, script: str) -> list[psutil.Process]:
    """The processes under `launcher` that run `script`: the ranks on this machine."""
    ranks = []
    for process in launcher.children(recursive=True):
        try:
            if runs_script(process.cmdline(), script):
                ranks.append(process)
        except psutil.Error:
            continue  # ended meanwhile
    return ranks


def _become_subreaper() -> None:
    """Make ranks orphaned by a killed runner (SIGTERM to DeepSpeed's runner, not to deepy.py) deepy.py's
    children, so that the stop still reaches them and deepy.py waits for them. Linux only; elsewhere nothing."""
    pr_set_child_subreaper = 36  # <linux/prctl.h>
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_child_subreaper, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _stop(ranks: list[psutil.Process], reason: str) -> None:
    print(f"deepy.py: {reason}; SIGTERM sent to the {len(ranks)} ranks here, which save a checkpoint and stop",
          file=sys.stderr, flush=True)
    for process in ranks:
        try:
            process.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass  # ended meanwhile


def run_launcher(command: list[str], script: str) -> int:
    """Run the launcher `command` of `script`'s ranks to its end; the exit code: the launcher's (128+N for a
    signal N), or, if the launcher was killed and its ranks here stopped on their own, theirs."""
    _become_subreaper()
    launcher = subprocess.Popen(command, start_new_session=True)
    this_process = psutil.Process()

    def stop(number: int, frame: object) -> None:
        ranks = _local_ranks(this_process, script)
        if ranks:
            _stop(ranks, f"{signal.Signals(number).name} received")
        else:  # ranks on other hosts: the launcher (srun, mpirun) forwards it to them
            launcher.send_signal(signal.SIGTERM)

    previous = {number: signal.signal(number, stop) for number in STOP_SIGNALS}
    try:
        code = launcher.wait()
        orphans = _local_ranks(this_process, script) if code < 0 else []
        if orphans:
            _stop(orphans, f"the launcher was ended by {signal.Signals(-code).name}")
            gone, _ = psutil.wait_procs(orphans)
            code = next((p.returncode for p in gone if p.returncode), 0)
        psutil.wait_procs(this_process.children(), timeout=60)  # runners left behind end with their ranks
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    code = code if code >= 0 else 128 - code
    if code:
        print(f"deepy.py: {script} failed (the launcher exited {code}); the first error printed above is the cause",
              file=sys.stderr, flush=True)
    return code
